//! Bad input, end to end through the real binaries: the launcher's flags and program, the `mlp`
//! example's data file, initial weights and checkpoint, and a collective that times out. Each
//! case must exit non-zero with a message that names the problem (the file, flag or rank) and
//! says what to do, and must leave no partial output behind (no model, metrics or checkpoint
//! written, no worker started, an existing checkpoint untouched).

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

use accelerate_tests::{output_text, Job};
use candle_core::{DType, Device, Tensor};

const LIMIT: Duration = Duration::from_secs(120);

/// A small, quick mlp run writing every kind of output into `dir`: the model as
/// `<run>.safetensors`, metrics as `<run>.jsonl` and a checkpoint per optimizer step under
/// `checkpoints`. 64 samples in batches of 8: 8 steps per epoch on one rank, 4 on two.
fn mlp_flags(dir: &Path, run: &str) -> Vec<String> {
    let at = |name: String| dir.join(name).to_str().unwrap().to_string();
    [
        "--hidden",
        "16",
        "--samples",
        "64",
        "--batch-size",
        "8",
        "--seed",
        "5",
        "--checkpoint-every",
        "1",
        "--checkpoint-dir",
        &at("checkpoints".into()),
        "--save-model",
        &at(format!("{run}.safetensors")),
        "--metrics",
        &at(format!("{run}.jsonl")),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// Runs the mlp with `args` on `ranks` processes: alone when 1, under the launcher otherwise
/// (with a grace period of 1 s).
fn run_mlp(ranks: usize, args: &[String]) -> Output {
    let mut job = Job::mlp(ranks).args(args).limit(LIMIT);
    if ranks > 1 {
        job = job.launcher_flags(["--grace-period", "1"]);
    }
    job.run().0
}

fn with(mut flags: Vec<String>, extra: &[&str]) -> Vec<String> {
    flags.extend(extra.iter().map(|s| s.to_string()));
    flags
}

/// Asserts a non-zero exit and that the output holds every one of `needles`.
fn assert_refused(o: &Output, needles: &[&str]) {
    let all = output_text(o);
    assert!(!o.status.success(), "the bad input was accepted:\n{all}");
    for needle in needles {
        assert!(all.contains(needle), "the output lacks {needle:?}:\n{all}");
    }
}

/// Asserts that a failed run of [`mlp_flags`] wrote nothing: no model, no metrics, no checkpoint.
fn assert_no_output(dir: &Path, run: &str, o: &Output) {
    let model = format!("{run}.safetensors");
    let metrics = format!("{run}.jsonl");
    assert_absent(dir, &[&model, &metrics, "checkpoints"], o);
}

/// Asserts that none of `names` exists in `dir`.
fn assert_absent(dir: &Path, names: &[&str], o: &Output) {
    for name in names {
        assert!(
            !dir.join(name).exists(),
            "{name} was left behind by a run that failed:\n{}",
            output_text(o)
        );
    }
}

fn path_str(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn save(path: &Path, tensors: &[(&str, Tensor)]) {
    let owned: Vec<(String, Tensor)> = tensors
        .iter()
        .map(|(n, t)| (n.to_string(), t.clone()))
        .collect();
    accelerate_core::save_safetensors(path, &owned).unwrap();
}

fn zeros(shape: &[usize], dtype: DType) -> Tensor {
    Tensor::zeros(shape, dtype, &Device::Cpu).unwrap()
}

#[test]
fn a_program_that_cannot_run_is_refused_before_anything_starts() {
    let dir = tempfile::tempdir().unwrap();
    let started = dir.path().join("started");
    let script = dir.path().join("train.sh");
    std::fs::write(
        &script,
        format!("#!/bin/sh\ntouch {}\n", path_str(&started)),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o644)).unwrap();
    let missing = dir.path().join("no-such-trainer");
    let cases: [(&Path, &[&str]); 3] = [
        (&script, &["is not executable", "chmod +x"]),
        (&missing, &["no such file", "check the path"]),
        (dir.path(), &["is a directory", "path of the executable"]),
    ];
    for (program, hints) in cases {
        let logs = dir.path().join("logs");
        let o = Job::new(program)
            .ranks(2)
            .launcher_flags([std::ffi::OsStr::new("--tee"), logs.as_os_str()])
            .limit(LIMIT)
            .run();
        assert_eq!(o.status.code(), Some(2), "{}", output_text(&o));
        let mut needles = vec![path_str(program)];
        needles.extend(hints);
        assert_refused(&o, &needles);
        assert_absent(dir.path(), &["logs", "started"], &o);
    }
}

#[test]
fn a_bad_port_is_refused_before_anything_starts() {
    let dir = tempfile::tempdir().unwrap();
    let started = dir.path().join("started");
    for port in ["70000", "http", ""] {
        let o = Job::new("sh")
            .launcher_flags(["--cpu", "--num-processes", "2", "--main-process-port", port])
            .args(["-c", &format!("touch {}", path_str(&started))])
            .limit(LIMIT)
            .run();
        assert_eq!(o.status.code(), Some(2), "{}", output_text(&o));
        assert_refused(
            &o,
            &[
                &format!("'{port}'"),
                "--main-process-port",
                "from 1 to 65535, or 0 to pick a free one",
            ],
        );
        assert_absent(dir.path(), &["started"], &o);
    }
}

#[test]
fn a_zero_stage_that_does_not_exist_is_refused_before_anything_starts() {
    let dir = tempfile::tempdir().unwrap();
    let started = dir.path().join("started");
    for (flag, stage, reason) in [
        ("--zero-stage", "4", "not a ZeRO stage"),
        ("--zero_stage", "x", "not a ZeRO stage"),
    ] {
        let o = Job::new("sh")
            .launcher_flags(["--cpu", "--num-processes", "2", flag, stage])
            .args(["-c", &format!("touch {}", path_str(&started))])
            .limit(LIMIT)
            .run();
        assert_eq!(o.status.code(), Some(2), "{}", o.text());
        assert_refused(
            &o,
            &[
                &format!("'{stage}'"),
                "--zero-stage",
                reason,
                "give 0 (plain data parallel), 1 (optimizer state sharded), 2",
            ],
        );
        assert_absent(dir.path(), &["started"], &o);
    }
}

#[test]
fn a_missing_data_file_is_named_on_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("nope.safetensors");
    let o = run_mlp(
        2,
        &with(mlp_flags(dir.path(), "run"), &["--data", path_str(&data)]),
    );
    // Whichever rank fails first is reported; the launcher stops the other.
    assert_refused(
        &o,
        &[
            &format!("] error: --data {}", data.display()),
            "does not exist; check the path",
            "exited with code 1; stopped the other ranks",
        ],
    );
    assert_no_output(dir.path(), "run", &o);
}

/// A data file: its name, its tensors, and what the refusal of it must say.
type DataCase = (&'static str, Vec<(&'static str, Tensor)>, Vec<&'static str>);

#[test]
fn a_data_file_of_the_wrong_shape_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let x = |rows: usize, features: usize| zeros(&[rows, features], DType::F32);
    let labels = |rows: usize| zeros(&[rows], DType::I64);
    let cases: Vec<DataCase> = vec![
        (
            "features",
            vec![("x", x(8, 10)), ("y", labels(8))],
            vec![
                "`x` has shape [8, 10]",
                "takes [N, 784]",
                "save x with 784 features per sample",
            ],
        ),
        (
            "no_labels",
            vec![("x", x(8, 784))],
            vec![
                "has no tensor \"y\" (it holds: x)",
                "tensors named \"x\" (features) and \"y\" (targets)",
            ],
        ),
        (
            "rows",
            vec![("x", x(8, 784)), ("y", labels(5))],
            vec![
                "\"x\" has 8 rows (shape [8, 784]) but \"y\" has 5",
                "one row per sample",
            ],
        ),
        (
            "float_labels",
            vec![("x", x(8, 784)), ("y", zeros(&[8], DType::F32))],
            vec!["`y` holds F32", "expected integer class labels"],
        ),
    ];
    for (name, tensors, needles) in cases {
        let data = dir.path().join(format!("{name}.safetensors"));
        save(&data, &tensors);
        let o = run_mlp(
            1,
            &with(mlp_flags(dir.path(), "run"), &["--data", path_str(&data)]),
        );
        let flag = format!("--data {}", data.display());
        let mut all = vec![flag.as_str()];
        all.extend(&needles);
        assert_refused(&o, &all);
        assert_no_output(dir.path(), "run", &o);
    }
    // Not a safetensors file at all.
    let data = dir.path().join("text.safetensors");
    std::fs::write(&data, "x,y\n0.1,3\n").unwrap();
    let o = run_mlp(
        1,
        &with(mlp_flags(dir.path(), "run"), &["--data", path_str(&data)]),
    );
    assert_refused(
        &o,
        &[
            path_str(&data),
            "is not a safetensors file",
            "safetensors.torch.save_file",
        ],
    );
    assert_no_output(dir.path(), "run", &o);
}

#[test]
fn initial_weights_of_a_different_model_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    // Weights of a real model of another width, written by the mlp itself.
    let wide = dir.path().join("wide.safetensors");
    let o = Job::mlp(1)
        .args(["--hidden", "32", "--samples", "64", "--max-steps", "0"])
        .arg("--save-model")
        .arg(&wide)
        .limit(LIMIT)
        .run();
    assert!(o.status.success(), "{}", output_text(&o));

    let o = run_mlp(
        2,
        &with(
            mlp_flags(dir.path(), "run"),
            &["--init-weights", path_str(&wide)],
        ),
    );
    assert_refused(
        &o,
        &[
            &format!(
                "--init-weights {} (this model: --hidden 16)",
                wide.display()
            ),
            "\"l1.weight\" has shape [32, 784], the model expects [16, 784]",
            "\"l3.weight\" has shape [10, 32], the model expects [10, 16]",
            "pass weights saved from the same architecture",
            "exited with code 1",
        ],
    );
    assert_no_output(dir.path(), "run", &o);

    // The right shapes under other names (another model's layer names).
    let renamed = dir.path().join("renamed.safetensors");
    save(
        &renamed,
        &[
            ("fc1.weight", zeros(&[16, 784], DType::F32)),
            ("fc1.bias", zeros(&[16], DType::F32)),
        ],
    );
    let o = run_mlp(
        1,
        &with(
            mlp_flags(dir.path(), "run"),
            &["--init-weights", path_str(&renamed)],
        ),
    );
    assert_refused(
        &o,
        &[
            path_str(&renamed),
            "missing \"l1.weight\" (expected shape [16, 784])",
            "unexpected tensor \"fc1.weight\" (not a parameter of this model)",
        ],
    );
    assert_no_output(dir.path(), "run", &o);
}

/// Every file under `dir` with its bytes.
fn tree(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut files = BTreeMap::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                pending.push(path);
            } else {
                files.insert(path.clone(), std::fs::read(&path).unwrap());
            }
        }
    }
    files
}

#[test]
fn a_corrupt_checkpoint_is_refused_under_resume_and_left_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let first = with(mlp_flags(dir.path(), "first"), &["--max-steps", "2"]);
    let o = run_mlp(2, &first);
    assert!(o.status.success(), "{}", output_text(&o));
    let ckpt = dir.path().join("checkpoints");
    let latest = ckpt.join("checkpoint_2");
    let parameters = latest.join("model.safetensors");
    let manifest = latest.join("manifest.json");
    assert!(
        parameters.exists() && manifest.exists(),
        "{:?}",
        tree(&ckpt).keys()
    );
    let intact = tree(&ckpt);

    type Damage = fn(&mut Vec<u8>);
    let flip: Damage = |bytes| {
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0x40;
    };
    let cut: Damage = |bytes| bytes.truncate(bytes.len() / 2);
    let cases: [(&Path, Damage, &str); 2] = [
        (&parameters, flip, "checksum mismatch"),
        (&manifest, cut, "the manifest is not valid"),
    ];
    for (file, damage, problem) in cases {
        let mut bytes = intact[file].clone();
        damage(&mut bytes);
        std::fs::write(file, &bytes).unwrap();
        let damaged = tree(&ckpt);

        // Resumed with other output names, so that anything it wrote would show.
        let resumed = ["--resume", "--max-steps", "4"];
        let o = run_mlp(2, &with(mlp_flags(dir.path(), "resumed"), &resumed));
        assert_refused(
            &o,
            &[
                &format!("--resume from {}", ckpt.display()),
                path_str(file),
                problem,
                "nothing was loaded or changed",
                &format!(
                    "delete {} to resume from the one before it",
                    latest.display()
                ),
                "run without --resume to start over",
            ],
        );
        assert_absent(
            dir.path(),
            &[
                "resumed.safetensors",
                "resumed.jsonl",
                "checkpoints/checkpoint_3",
            ],
            &o,
        );
        assert!(
            tree(&ckpt) == damaged,
            "a failed resume changed the checkpoints:\n{}",
            output_text(&o)
        );
        std::fs::write(file, &intact[file]).unwrap();
    }
    // The restored checkpoint resumes: the refusals were about the damage alone.
    let o = run_mlp(
        2,
        &with(
            mlp_flags(dir.path(), "last"),
            &["--resume", "--max-steps", "3"],
        ),
    );
    assert!(o.status.success(), "{}", output_text(&o));
    assert!(
        output_text(&o).contains("resumed from") && ckpt.join("checkpoint_3").exists(),
        "{}",
        output_text(&o)
    );
}

#[test]
fn a_collective_that_times_out_names_the_stalled_rank_and_stops_the_job() {
    // Rank 1 stays alive but never joins: it is waited for up to the busy limit (not the much
    // shorter silence limit, which only applies to a peer without any sign of life).
    let (silence, busy) = (1.0, 3.0);
    for transport in ["tcp", "shm"] {
        let job = Job::worker()
            .ranks(2)
            .launcher_flags(["--grace-period", "1"])
            .arg("stall")
            .env("ACCELERATE_COLLECTIVE_TIMEOUT", silence.to_string())
            .env("ACCELERATE_BUSY_PEER_TIMEOUT", busy.to_string())
            .env("ACCELERATE_CPU_TRANSPORT", transport)
            .limit(LIMIT);
        let started = Instant::now();
        let o = job.run();
        let took = started.elapsed();
        assert_refused(
            &o,
            &[
                "[rank 0] error: timed out after 3s waiting for rank 1",
                "all_reduce #",
                "it is alive",
                "rank 1 may have hung, be busy outside the collective",
                "raise the limit with ACCELERATE_BUSY_PEER_TIMEOUT=<seconds>",
                "accelerate-launch: rank 0 (pid",
                "exited with code 1; stopped the other ranks",
            ],
        );
        // It waited for the busy limit, then gave up promptly (rank 1 would sleep for 600 s).
        assert!(
            took >= Duration::from_secs_f64(busy) && took < Duration::from_secs(30),
            "over {transport}, the job ended after {took:?}:\n{}",
            output_text(&o)
        );
    }
}
