//! Files on disk: written atomically (temporary file, fsync, rename, fsync of the directory), so a
//! crash or a full disk at any moment leaves the previous file intact; and safetensors in and out
//! with errors that name the file and the tensor.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

use candle_core::{Device, Tensor};

use crate::error::{Error, Result};

/// Writes `bytes` to `path` atomically: the file either keeps its old content or has the new one.
pub fn write_atomic(path: impl AsRef<Path>, bytes: &[u8]) -> Result<()> {
    let path = path.as_ref();
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    let name = path
        .file_name()
        .ok_or_else(|| Error::Config(format!("{} is not a file path", path.display())))?;
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let tmp = dir.join(format!(
        ".{}.tmp.{}.{}",
        name.to_string_lossy(),
        std::process::id(),
        WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let result = (|| -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, path)?;
        // Make the rename itself durable.
        if let Ok(d) = std::fs::File::open(&dir) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::io(path, e));
    }
    Ok(())
}

/// Saves named tensors as a safetensors file, atomically.
pub fn save_safetensors(path: impl AsRef<Path>, tensors: &[(String, Tensor)]) -> Result<()> {
    let path = path.as_ref();
    let cpu: Vec<(String, Tensor)> = tensors
        .iter()
        .map(|(n, t)| Ok((n.clone(), t.to_device(&Device::Cpu)?.contiguous()?)))
        .collect::<Result<_>>()?;
    let bytes = safetensors::tensor::serialize(cpu.iter().map(|(n, t)| (n.as_str(), t)), None)
        .map_err(|e| Error::Data(format!("{}: cannot serialize tensors: {e}", path.display())))?;
    write_atomic(path, &bytes)
}

/// Loads every tensor of a safetensors file onto `device`.
pub fn load_safetensors(
    path: impl AsRef<Path>,
    device: &Device,
) -> Result<HashMap<String, Tensor>> {
    let path = path.as_ref();
    if !path.exists() {
        return Err(Error::io(
            path,
            std::io::Error::new(std::io::ErrorKind::NotFound, "no such file; check the path"),
        ));
    }
    candle_core::safetensors::load(path, device).map_err(|e| {
        Error::Data(format!(
            "{}: not a readable safetensors file ({e}); write it with safetensors' save_file",
            path.display()
        ))
    })
}

/// Overwrites the given parameters with the tensors of a safetensors file. The file must hold
/// exactly these names with these shapes; any difference is an error listing every mismatch, and
/// nothing is modified unless everything matches.
pub fn load_into_vars(path: impl AsRef<Path>, params: &[(String, candle_core::Var)]) -> Result<()> {
    let path = path.as_ref();
    let Some(first) = params.first() else {
        return Ok(());
    };
    let tensors = load_safetensors(path, first.1.device())?;
    let mut problems = Vec::new();
    for (name, var) in params {
        match tensors.get(name) {
            None => problems.push(format!(
                "missing {name:?} (expected shape {:?})",
                var.dims()
            )),
            Some(t) if t.dims() != var.dims() => problems.push(format!(
                "{name:?} has shape {:?}, the model expects {:?}",
                t.dims(),
                var.dims()
            )),
            Some(_) => {}
        }
    }
    let mut extra: Vec<&String> = tensors
        .keys()
        .filter(|k| !params.iter().any(|(n, _)| n == *k))
        .collect();
    extra.sort();
    for name in extra {
        problems.push(format!(
            "unexpected tensor {name:?} (not a parameter of this model)"
        ));
    }
    if !problems.is_empty() {
        return Err(Error::Parameters(format!(
            "{} does not fit this model: {}; pass weights saved from the same architecture \
             (same layer sizes)",
            path.display(),
            problems.join("; ")
        )));
    }
    for (name, var) in params {
        let t = &tensors[name];
        var.set(&t.to_dtype(var.dtype())?)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Var;

    #[test]
    fn atomic_write_replaces_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f.bin");
        write_atomic(&p, b"one").unwrap();
        write_atomic(&p, b"two").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn failed_write_keeps_the_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f.bin");
        write_atomic(&p, b"old").unwrap();
        // A directory in place of the target makes the rename fail.
        let q = dir.path().join("d");
        std::fs::create_dir(&q).unwrap();
        std::fs::write(q.join("x"), b"x").unwrap();
        assert!(write_atomic(&q, b"new").is_err());
        assert_eq!(std::fs::read(&p).unwrap(), b"old");
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(left.len(), 2, "no temporary file is left behind");
    }

    #[test]
    fn weights_round_trip_and_mismatches_are_listed() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("w.safetensors");
        let a = Var::new(&[[1f32, 2.0], [3.0, 4.0]], &Device::Cpu).unwrap();
        let b = Var::new(&[5f32], &Device::Cpu).unwrap();
        save_safetensors(
            &p,
            &[
                ("a".into(), a.as_tensor().clone()),
                ("b".into(), b.as_tensor().clone()),
            ],
        )
        .unwrap();
        let a2 = Var::zeros((2, 2), candle_core::DType::F32, &Device::Cpu).unwrap();
        let b2 = Var::zeros(1, candle_core::DType::F32, &Device::Cpu).unwrap();
        load_into_vars(&p, &[("a".into(), a2.clone()), ("b".into(), b2.clone())]).unwrap();
        assert_eq!(
            a2.to_vec2::<f32>().unwrap(),
            vec![vec![1., 2.], vec![3., 4.]]
        );
        assert_eq!(b2.to_vec1::<f32>().unwrap(), vec![5.]);

        let wrong = Var::zeros((3, 2), candle_core::DType::F32, &Device::Cpu).unwrap();
        let c = Var::zeros(1, candle_core::DType::F32, &Device::Cpu).unwrap();
        let e = load_into_vars(&p, &[("a".into(), wrong.clone()), ("c".into(), c)])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("\"a\" has shape [2, 2], the model expects [3, 2]"),
            "{e}"
        );
        assert!(
            e.contains("missing \"c\"") && e.contains("unexpected tensor \"b\""),
            "{e}"
        );
        assert_eq!(wrong.sum_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
        let e = load_into_vars(dir.path().join("nope"), &[("a".into(), a2)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("nope") && e.contains("no such file"), "{e}");
    }
}
