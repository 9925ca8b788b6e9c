//! The Kubernetes manifests (`examples/kubernetes/*.yaml`, Kubeflow PyTorchJobs): no cluster runs
//! them here, so this checks what can be checked without one. Each parses as YAML, is a
//! `kubeflow.org/v1` PyTorchJob with one Master and some Workers whose container is the one the
//! Training Operator configures (named `pytorch`, port `pytorchjob-port`), every rank gets the
//! job token from a Secret, and every program it runs from the image is one the `Dockerfile`
//! copies there.

use std::path::{Path, PathBuf};

use serde_yaml_ng::Value;

fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn manifests() -> Vec<PathBuf> {
    let dir = repository().join("examples/kubernetes");
    let mut found: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    found.sort();
    assert!(!found.is_empty(), "no manifests in {}", dir.display());
    found
}

/// `value[key1][key2]...`, failing with the path when a key is missing.
fn at<'a>(value: &'a Value, keys: &[&str], file: &Path) -> &'a Value {
    keys.iter().fold(value, |v, k| {
        v.get(*k)
            .unwrap_or_else(|| panic!("{}: no {} ", file.display(), keys.join(".")))
    })
}

/// The files the Docker image holds under /opt/accelerate: the Dockerfile's `cp ... /out/...`
/// lines (the build stage's /out becomes /opt/accelerate), as paths under /opt/accelerate.
fn image_files() -> Vec<String> {
    let dockerfile = std::fs::read_to_string(repository().join("Dockerfile")).unwrap();
    assert!(
        dockerfile.contains("COPY --from=build /out /opt/accelerate"),
        "the Dockerfile no longer ships /out as /opt/accelerate; update this test"
    );
    let mut files = Vec::new();
    for line in dockerfile.lines() {
        let words: Vec<&str> = line
            .split_whitespace()
            .filter(|w| !matches!(*w, "&&" | "\\"))
            .collect();
        if words.first() != Some(&"cp") || words.len() < 3 {
            continue;
        }
        let dest = words[words.len() - 1];
        let Some(dest) = dest.strip_prefix("/out") else {
            continue;
        };
        for source in &words[1..words.len() - 1] {
            let name = source.rsplit('/').next().unwrap();
            files.push(format!(
                "/opt/accelerate{}/{name}",
                dest.trim_end_matches('/')
            ));
        }
    }
    files
}

#[test]
fn pytorchjob_manifests_parse_and_run_what_the_image_ships() {
    let shipped = image_files();
    assert!(
        shipped.contains(&"/opt/accelerate/accelerate-launch".to_string()),
        "{shipped:?}"
    );
    for file in manifests() {
        let text = std::fs::read_to_string(&file).unwrap();
        let job: Value = serde_yaml_ng::from_str(&text)
            .unwrap_or_else(|e| panic!("{} is not YAML: {e}", file.display()));
        assert_eq!(
            at(&job, &["apiVersion"], &file).as_str(),
            Some("kubeflow.org/v1")
        );
        assert_eq!(at(&job, &["kind"], &file).as_str(), Some("PyTorchJob"));
        let replicas = at(&job, &["spec", "pytorchReplicaSpecs"], &file);
        assert_eq!(
            at(replicas, &["Master", "replicas"], &file).as_u64(),
            Some(1),
            "{}: one Master (rank 0)",
            file.display()
        );
        for role in ["Master", "Worker"] {
            let containers = at(replicas, &[role, "template", "spec", "containers"], &file);
            let pytorch = containers
                .as_sequence()
                .and_then(|c| {
                    c.iter()
                        .find(|c| c.get("name").and_then(Value::as_str) == Some("pytorch"))
                })
                .unwrap_or_else(|| {
                    panic!("{}: {role} has no container named pytorch", file.display())
                });
            let ports = format!("{:?}", at(pytorch, &["ports"], &file));
            assert!(
                ports.contains("pytorchjob-port"),
                "{}: {role}: {ports}",
                file.display()
            );
            let env = at(pytorch, &["env"], &file).as_sequence().unwrap();
            let token = env
                .iter()
                .find(|v| v.get("name").and_then(Value::as_str) == Some("ACCELERATE_JOB_TOKEN"))
                .unwrap_or_else(|| {
                    panic!("{}: {role} gets no ACCELERATE_JOB_TOKEN", file.display())
                });
            assert!(
                token
                    .get("valueFrom")
                    .and_then(|v| v.get("secretKeyRef"))
                    .is_some(),
                "{}: {role}: the token comes from a Secret",
                file.display()
            );
            // Every /opt/accelerate path and bare launcher the command runs is in the image.
            let command: Vec<&str> = at(pytorch, &["command"], &file)
                .as_sequence()
                .unwrap()
                .iter()
                .map(|w| w.as_str().unwrap())
                .collect();
            for word in command.iter().flat_map(|c| c.split_whitespace()) {
                let word = word.trim_matches('"');
                let program = if word.starts_with("/opt/accelerate/") {
                    word.to_string()
                } else if matches!(word, "accelerate-launch" | "accelerate") {
                    format!("/opt/accelerate/{word}")
                } else {
                    continue;
                };
                assert!(
                    shipped.contains(&program),
                    "{}: {role} runs {program}, which the Dockerfile does not ship ({shipped:?})",
                    file.display()
                );
            }
        }
    }
}

/// The multi-GPU manifest's command under the two ways the operator can describe a pod: each pod
/// must get the pod count as --num-machines, its index as --machine-rank, and pods × GPUs as
/// --num-processes (here 2 pods of 8 GPUs, the second pod). A stand-in `accelerate-launch` on
/// PATH prints the flags it gets.
#[test]
fn the_multi_gpu_command_gets_the_pod_count_and_index() {
    let file = repository().join("examples/kubernetes/pytorchjob-multi-gpu.yaml");
    let job: Value = serde_yaml_ng::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let stand_in = dir.path().join("accelerate-launch");
    std::fs::write(&stand_in, "#!/bin/sh\necho \"$@\"\n").unwrap();
    std::fs::set_permissions(
        &stand_in,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let path = format!(
        "{}:{}",
        dir.path().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let want = "--num-machines 2 --machine-rank 1 --main-process-ip master-0 --main-process-port \
                23456 --num-processes 16 /opt/accelerate/examples/mlp --grad-accum 4";
    for role in ["Master", "Worker"] {
        let command = at(
            &job,
            &[
                "spec",
                "pytorchReplicaSpecs",
                role,
                "template",
                "spec",
                "containers",
            ],
            &file,
        )[0]["command"]
            .as_sequence()
            .unwrap()
            .iter()
            .map(|w| w.as_str().unwrap().to_string())
            .collect::<Vec<_>>();
        assert_eq!(&command[..2], ["sh", "-c"], "{role}");
        // Without nprocPerNode: WORLD_SIZE and RANK count pods. With it (where the operator sets
        // torchrun's PET_ variables): WORLD_SIZE and RANK count processes, PET_ ones pods.
        let without: &[(&str, &str)] = &[("WORLD_SIZE", "2"), ("RANK", "1")];
        let with: &[(&str, &str)] = &[
            ("WORLD_SIZE", "16"),
            ("RANK", "9"),
            ("PET_NNODES", "2"),
            ("PET_NODE_RANK", "1"),
        ];
        for vars in [without, with] {
            let mut run = accelerate_tests::Job::new("sh")
                .args(["-c", &command[2]])
                .env("PATH", &path)
                .env("GPUS_PER_POD", "8")
                .env("MASTER_ADDR", "master-0")
                .env("MASTER_PORT", "23456")
                .env_remove("PET_NNODES")
                .env_remove("PET_NODE_RANK");
            for (k, v) in vars {
                run = run.env(k, v);
            }
            let o = run.run();
            assert!(o.status.success(), "{role} {vars:?}: {}", o.text());
            assert_eq!(o.stdout_text().trim(), want, "{role} {vars:?}");
        }
    }
}
