//! The training program, checked before anything starts (the store, the log directory, the
//! workers): a wrong path fails at once, with the fix, and leaves nothing behind.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

/// Checks that `program` names an executable file, found as `exec` finds it: a name without a
/// `/` is looked up in `PATH`, anything else is a path. The message names the program and says
/// what to do.
pub fn check_program(program: &Path) -> Result<(), String> {
    let shown = program.display();
    if program.as_os_str().is_empty() {
        return Err("the program is an empty string; give the path of the training program".into());
    }
    if !program.as_os_str().as_encoded_bytes().contains(&b'/') {
        let path = std::env::var_os("PATH").unwrap_or_default();
        let found = std::env::split_paths(&path)
            .map(|dir| dir.join(program))
            .any(|candidate| check_file(&candidate).is_ok());
        return if found {
            Ok(())
        } else {
            Err(format!(
                "program {shown:?} is not in PATH; give its path instead (e.g. ./{shown} or \
                 target/release/examples/{shown})"
            ))
        };
    }
    check_file(program)
}

fn check_file(path: &Path) -> Result<(), String> {
    let shown = path.display();
    let meta = std::fs::metadata(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => format!(
            "program {shown}: no such file; check the path (examples are built by `cargo build \
             --release --examples` into target/release/examples/)"
        ),
        _ => format!("program {shown}: cannot read it ({e}); check the path and its permissions"),
    })?;
    if meta.is_dir() {
        return Err(format!(
            "program {shown} is a directory; give the path of the executable inside it"
        ));
    }
    if meta.permissions().mode() & 0o111 == 0 {
        return Err(format!(
            "program {shown} is not executable; make it executable (chmod +x {shown}) or launch \
             its interpreter with it as the argument (e.g. `accelerate-launch ... python3 \
             {shown}`)"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn programs_are_found_in_path_or_at_their_path() {
        assert!(check_program(Path::new("sh")).is_ok());
        assert!(check_program(Path::new("/bin/sh")).is_ok());
        let e = check_program(Path::new("no-such-program-anywhere")).unwrap_err();
        assert!(e.contains("is not in PATH"), "{e}");
        let e = check_program(Path::new("/nonexistent/trainer")).unwrap_err();
        assert!(e.contains("/nonexistent/trainer: no such file"), "{e}");
    }

    #[test]
    fn directories_and_files_without_execute_permission_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let e = check_program(dir.path()).unwrap_err();
        assert!(e.contains("is a directory"), "{e}");
        let script = dir.path().join("train.sh");
        std::fs::write(&script, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = check_program(&script).unwrap_err();
        assert!(
            e.contains("is not executable") && e.contains("chmod +x"),
            "{e}"
        );
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(check_program(&script).is_ok());
    }
}
