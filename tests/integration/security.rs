//! The rendezvous store of workers that torchrun (or SLURM, or mpirun) started, without our
//! launcher: real worker processes, and a client of the test's own that tries to join them.
//!
//! - On one machine with no `ACCELERATE_JOB_TOKEN`, rank 0 makes a token in a file only this user
//!   can read (mode 0600 in a 0700 folder): a client without it (another user of the machine)
//!   cannot join, and the file's token lets a client in.
//! - On several machines with no token, every rank refuses to start, naming
//!   `ACCELERATE_JOB_TOKEN` and the opt-out `ACCELERATE_ALLOW_OPEN_STORE`; with the opt-out the
//!   job runs, and rank 0 warns.

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::time::Duration;

use accelerate_core::comm::TcpStoreClient;
use accelerate_tests::{free_port, output_text, Job};

const LIMIT: Duration = Duration::from_secs(120);

/// Rank `rank` of `world` ranks, `local` of them on its machine, started like torchrun starts
/// them, with the store (rank 0's) on `port` (torchrun's own would hold `port - 1`).
fn torchrun_rank(scenario: &str, rank: usize, world: usize, local: usize, port: u16) -> Job {
    Job::worker()
        .arg(scenario)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_RANK", (rank % local).to_string())
        .env("LOCAL_WORLD_SIZE", local.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", (port - 1).to_string())
        .limit(LIMIT)
}

/// Where the book says rank 0 of a one-machine job keeps the token of the store on `port`
/// (written out here from the documentation, not taken from the code under test).
fn documented_token_file(port: u16) -> PathBuf {
    // This user's id: the owner of a folder it just made.
    let made = tempfile::tempdir().unwrap();
    let uid = std::fs::metadata(made.path()).unwrap().uid();
    let runtime = std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .filter(|dir| {
            std::fs::symlink_metadata(dir)
                .is_ok_and(|m| m.is_dir() && m.uid() == uid && m.mode() & 0o077 == 0)
        });
    let folder = match runtime {
        Some(dir) => dir.join("accelerate-rs"),
        None => std::env::temp_dir().join(format!("accelerate-rs-{uid}")),
    };
    folder.join(format!("store-{port}.token"))
}

#[test]
fn a_one_machine_job_without_a_token_admits_only_clients_that_hold_its_token_file() {
    let port = free_port();
    // Rank 1 sleeps after joining, so the store stays up until the test ends the job.
    let mut ranks: Vec<_> = (0..2)
        .map(|rank| {
            torchrun_rank("stall", rank, 2, 2, port)
                .command()
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    let store = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let wait = Duration::from_secs(60);
    // A client without the token (another user of the machine cannot read the file).
    let intruder = TcpStoreClient::connect(store, "", 0, 7, wait);
    let refused = intruder.as_ref().err().map(ToString::to_string);
    // The file is where the book says, 0600 in a 0700 folder, and its token lets a client in.
    let file = documented_token_file(port);
    let token = std::fs::read_to_string(&file);
    let modes = std::fs::metadata(&file).and_then(|f| {
        let folder = std::fs::metadata(file.parent().unwrap())?;
        Ok((f.mode() & 0o777, folder.mode() & 0o777))
    });
    let member = match &token {
        Ok(token) => Some(TcpStoreClient::connect(store, token.trim(), 0, 8, wait).map(drop)),
        Err(_) => None,
    };
    for rank in &mut ranks {
        let _ = rank.kill();
        let _ = rank.wait();
    }
    // Killed, rank 0 could not remove it.
    let _ = std::fs::remove_file(&file);
    let refused = refused.expect("a client without the job's token joined its store");
    assert!(refused.contains("did not prove"), "{refused}");
    let token = token.unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    assert_eq!(token.trim().len(), 64, "{token:?}");
    assert_eq!(modes.unwrap(), (0o600, 0o700));
    member
        .unwrap()
        .expect("a client with the token file's token was refused");
}

#[test]
fn ranks_on_several_machines_without_a_token_refuse_to_start_unless_told_the_network_is_closed() {
    // Two "machines" of one rank each; the store's address is given as loopback, which such
    // machines (network namespaces, this test) share.
    let port = free_port();
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let job = torchrun_rank("allreduce", rank, 2, 1, port);
            std::thread::spawn(move || job.run())
        })
        .collect();
    for (rank, o) in ranks.into_iter().map(|t| t.join().unwrap()).enumerate() {
        let text = output_text(&o);
        assert!(!o.status.success(), "rank {rank} started: {text}");
        assert!(
            text.contains("ACCELERATE_JOB_TOKEN") && text.contains("ACCELERATE_ALLOW_OPEN_STORE=1"),
            "rank {rank}: {text}"
        );
    }
    // Told that the network is closed, the job runs without a token, and rank 0 warns.
    let port = free_port();
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let job = torchrun_rank("allreduce", rank, 2, 1, port)
                .env("ACCELERATE_ALLOW_OPEN_STORE", "1");
            std::thread::spawn(move || job.run())
        })
        .collect();
    let outputs: Vec<_> = ranks.into_iter().map(|t| t.join().unwrap()).collect();
    for (rank, o) in outputs.iter().enumerate() {
        assert!(o.status.success(), "rank {rank}: {}", output_text(o));
    }
    let rank0 = output_text(&outputs[0]);
    assert!(
        rank0.contains("WARNING: ACCELERATE_ALLOW_OPEN_STORE is set"),
        "{rank0}"
    );
}
