//! `Accelerator::log` under the launcher: ranks sharing one logging directory leave the files of
//! the main process only.

use std::time::Duration;

use accelerate_tests::Job;

#[test]
fn only_the_main_process_writes_to_a_shared_logging_dir() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("runs");
    let o = Job::worker()
        .ranks(2)
        .arg("log")
        .arg(&dir)
        .limit(Duration::from_secs(240))
        .run();
    assert!(o.status.success(), "{}", o.text());
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    // One event file (a second rank writing would add its own), the two tables, the PNG.
    assert_eq!(names.len(), 4, "{names:?}");
    assert!(names[0].starts_with("events.out.tfevents."), "{names:?}");
    assert_eq!(
        names[1..],
        ["metrics.csv", "metrics.jsonl", "training_curves.png"]
    );
    let jsonl = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    let ranks: Vec<(u64, f64)> = jsonl
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["step"].as_u64().unwrap(), v["rank"].as_f64().unwrap())
        })
        .collect();
    assert_eq!(ranks, [(1, 0.0), (2, 0.0), (3, 0.0)]);
    let csv = std::fs::read_to_string(dir.join("metrics.csv")).unwrap();
    assert_eq!(
        csv,
        "step,train/loss,rank\n1,1,0\n2,0.5,0\n3,0.3333333333333333,0\n"
    );
}
