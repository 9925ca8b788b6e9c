//! Two machines' launchers in one process, over a real store on loopback.

use std::time::Duration;

use accelerate_core::comm::{Store, StoreServer, TcpStoreClient};

use super::*;
use crate::signals::SignalWatch;

const TOKEN: &str = "machines-test-token";
const WAIT: Duration = Duration::from_secs(10);
const GRACE: Duration = Duration::from_secs(1);

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// A store with the launchers of machines 0 and 1 joined to it.
fn two_machines() -> (StoreServer, MachineLink, MachineLink) {
    let store = StoreServer::start("127.0.0.1:0".parse().unwrap(), TOKEN.into(), 0).unwrap();
    let addr = store.local_addr();
    let m0 = MachineLink::join(addr, TOKEN, 0, 2, "host-a", WAIT).unwrap();
    let m1 = MachineLink::join(addr, TOKEN, 1, 2, "host-b", WAIT).unwrap();
    (store, m0, m1)
}

/// Machines 0 and 1 settle `attempt` together, machine 0 with `max_restarts` (machine 1's value,
/// 0, never counts). After a verdict other than a restart machine 1's launcher exits, as the real
/// one does: its connection closes, which machine 0 waits for before it returns.
fn settle_both(
    rt: &tokio::runtime::Runtime,
    store: &StoreServer,
    m0: &mut MachineLink,
    m1: &mut MachineLink,
    attempt: u32,
    max_restarts: u32,
) -> (Next, Next) {
    rt.block_on(async {
        let mut s0 = SignalWatch::silent();
        let mut s1 = SignalWatch::silent();
        tokio::join!(
            m0.settle(attempt, Some(store), max_restarts, GRACE, &mut s0),
            async {
                let next = m1.settle(attempt, None, 0, GRACE, &mut s1).await;
                if next != Next::Restart {
                    m1.watch.disconnect(); // the launcher exits
                }
                next
            }
        )
    })
}

/// Machine 0's verdict on attempt 0 when nothing more is heard from the others: time is paused,
/// so its waits pass at once. Returns the reason of the exit (code 1) it decides.
fn verdict_of_machine_0_alone(
    rt: &tokio::runtime::Runtime,
    store: &StoreServer,
    m0: &mut MachineLink,
) -> String {
    let next = rt.block_on(async {
        let mut s0 = SignalWatch::silent();
        tokio::time::pause();
        m0.settle(0, Some(store), 5, GRACE, &mut s0).await
    });
    let Next::Exit { code: 1, reason } = next else {
        panic!("{next:?}")
    };
    reason
}

#[test]
fn a_failure_on_one_machine_stops_the_other_naming_it() {
    let rt = runtime();
    let (_store, mut m0, mut m1) = two_machines();
    m1.report_end(
        0,
        LocalEnd::Failed("rank 3 (pid 77) exited with code 1".into()),
    )
    .unwrap();
    let reason = rt.block_on(async {
        tokio::time::timeout(WAIT, m0.stop_reason(0))
            .await
            .expect("machine 0 hears of machine 1's failure")
    });
    assert!(reason.contains("machine 1 (host-b)"), "{reason}");
    assert!(
        reason.contains("rank 3 (pid 77) exited with code 1"),
        "{reason}"
    );
}

#[test]
fn a_success_elsewhere_does_not_stop_the_workers() {
    let rt = runtime();
    let (_store, mut m0, mut m1) = two_machines();
    m1.report_end(0, LocalEnd::Success).unwrap();
    // Once machine 0 has read machine 1's success, it still has no reason to stop.
    rt.block_on(async {
        while m0.end_of(1, 0).is_none() {
            m0.next_event().await;
        }
    });
    assert_eq!(m0.reason_to_stop(0), None);
}

#[test]
fn both_succeed_and_both_exit_zero() {
    let rt = runtime();
    let (store, mut m0, mut m1) = two_machines();
    m1.report_end(0, LocalEnd::Success).unwrap();
    m0.report_end(0, LocalEnd::Success).unwrap();
    let (n0, n1) = settle_both(&rt, &store, &mut m0, &mut m1, 0, 3);
    assert_eq!(
        n0,
        Next::Exit {
            code: 0,
            reason: String::new()
        }
    );
    assert_eq!(n1, n0);
    assert_eq!(store.service().generation(), 0);
}

#[test]
fn a_failure_restarts_both_machines_in_a_new_generation_while_restarts_remain() {
    let rt = runtime();
    let (store, mut m0, mut m1) = two_machines();
    // A worker of generation 0 holds a connection that the restart must turn away.
    let old_worker = TcpStoreClient::connect(store.local_addr(), TOKEN, 0, 5, WAIT).unwrap();
    for attempt in 0..2 {
        m1.report_end(
            attempt,
            LocalEnd::Failed(format!("rank 2 failed in attempt {attempt}")),
        )
        .unwrap();
        m0.report_end(attempt, LocalEnd::Stopped("machine 1 failed".into()))
            .unwrap();
        let (n0, n1) = settle_both(&rt, &store, &mut m0, &mut m1, attempt, 1);
        assert_eq!(n1, n0, "attempt {attempt}");
        if attempt == 0 {
            // Machine 0's --max-restarts (1) decides, not machine 1's (0).
            assert_eq!(n0, Next::Restart);
            assert_eq!(store.service().generation(), 1);
            let refused = old_worker.get("anything", WAIT).unwrap_err().to_string();
            assert!(refused.contains("generation 0"), "{refused}");
        } else {
            let Next::Exit { code, reason } = n0 else {
                panic!("{n0:?}")
            };
            assert_eq!(code, 1);
            assert!(
                reason.contains("machine 1 (host-b): failed: rank 2 failed in attempt 1"),
                "{reason}"
            );
            assert!(reason.contains("giving up after 1 restart(s)"), "{reason}");
        }
    }
}

#[test]
fn a_signal_on_one_machine_ends_the_job_without_a_restart() {
    let rt = runtime();
    let (store, mut m0, mut m1) = two_machines();
    m1.report_end(0, LocalEnd::Interrupted(libc::SIGTERM))
        .unwrap();
    m0.report_end(0, LocalEnd::Stopped("machine 1 received SIGTERM".into()))
        .unwrap();
    let (n0, n1) = settle_both(&rt, &store, &mut m0, &mut m1, 0, 5);
    assert_eq!(n0, n1);
    let Next::Exit { code: 1, reason } = n0 else {
        panic!("{n0:?}")
    };
    assert!(
        reason.contains("machine 1 (host-b)'s launcher received SIGTERM"),
        "{reason}"
    );
    assert_eq!(store.service().generation(), 0);
}

#[test]
fn a_machine_that_never_reports_is_named_after_the_grace_period() {
    let rt = runtime();
    let (store, mut m0, _m1) = two_machines();
    m0.report_end(0, LocalEnd::Failed("rank 0 exited with code 1".into()))
        .unwrap();
    // Machine 0 has heard machine 1 join (the follower thread runs in real time).
    rt.block_on(async {
        while !m0.hosts.contains_key(&1) {
            m0.next_event().await;
        }
    });
    let reason = verdict_of_machine_0_alone(&rt, &store, &mut m0);
    // The short wait that follows a failure: grace (1 s) + 60 s.
    assert!(
        reason.contains("machine 1 (host-b) did not report")
            && reason.contains("within 61s after the attempt went wrong"),
        "{reason}"
    );
}

#[test]
fn a_wrong_token_is_refused_with_the_fix() {
    let store = StoreServer::start("127.0.0.1:0".parse().unwrap(), TOKEN.into(), 0).unwrap();
    let e = MachineLink::join(store.local_addr(), "other-token", 1, 2, "h", WAIT).unwrap_err();
    assert!(e.contains("machine 1 cannot join"), "{e}");
    assert!(e.contains("same ACCELERATE_JOB_TOKEN"), "{e}");
}

#[test]
fn machine_0_keeps_the_store_until_the_others_have_read_the_verdict() {
    let rt = runtime();
    let (store, mut m0, mut m1) = two_machines();
    m1.report_end(0, LocalEnd::Success).unwrap();
    m0.report_end(0, LocalEnd::Success).unwrap();
    let (n0, n1) = settle_both(&rt, &store, &mut m0, &mut m1, 0, 0);
    assert_eq!(
        n0,
        Next::Exit {
            code: 0,
            reason: String::new()
        }
    );
    assert_eq!(n1, n0);
    // Machine 0 returned (and would shut its store down) only once machine 1 had left.
    assert!(m0.departed.contains(&1));
}

#[test]
fn machine_0_gives_up_on_a_machine_whose_launcher_went_silent_before_it_reported() {
    let rt = runtime();
    let (store, mut m0, mut m1) = two_machines();
    // Machine 1's launcher freezes: its connection stays open, its heartbeat stops.
    m1.stop_heartbeat();
    m0.report_end(0, LocalEnd::Success).unwrap();
    rt.block_on(async {
        while !m0.hosts.contains_key(&1) {
            m0.next_event().await;
        }
    });
    let reason = verdict_of_machine_0_alone(&rt, &store, &mut m0);
    assert!(
        reason.contains("machine 1 (host-b) gave no sign of life for 10s")
            && reason.contains("before it reported the end of its workers"),
        "{reason}"
    );
}

#[test]
fn machine_1_gives_up_on_machine_0_whose_launcher_went_silent() {
    let rt = runtime();
    let (_store, mut m0, mut m1) = two_machines();
    m0.stop_heartbeat();
    m1.report_end(0, LocalEnd::Success).unwrap();
    let next = rt.block_on(async {
        let mut s1 = SignalWatch::silent();
        tokio::time::pause();
        m1.settle(0, None, 0, GRACE, &mut s1).await
    });
    let Next::Exit { code: 1, reason } = next else {
        panic!("{next:?}")
    };
    assert!(
        reason.contains("machine 0's launcher gave no sign of life for 10s"),
        "{reason}"
    );
}

#[test]
fn machine_0_waits_for_a_machine_whose_workers_run_past_the_silence_limit() {
    // Real time, a silence limit of 0.3 s: machine 1's workers finish four limits after machine
    // 0's. Its launcher is alive all along (its heartbeat advances), so machine 0 waits for it.
    let silence = Duration::from_millis(300);
    let rt = runtime();
    let store = StoreServer::start("127.0.0.1:0".parse().unwrap(), TOKEN.into(), 0).unwrap();
    let addr = store.local_addr();
    let mut m0 = MachineLink::join(addr, TOKEN, 0, 2, "host-a", silence).unwrap();
    let mut m1 = MachineLink::join(addr, TOKEN, 1, 2, "host-b", silence).unwrap();
    m0.report_end(0, LocalEnd::Success).unwrap();
    let (n0, n1) = rt.block_on(async {
        let mut s0 = SignalWatch::silent();
        let mut s1 = SignalWatch::silent();
        tokio::join!(m0.settle(0, Some(&store), 0, GRACE, &mut s0), async {
            tokio::time::sleep(4 * silence).await;
            m1.report_end(0, LocalEnd::Success).unwrap();
            let next = m1.settle(0, None, 0, GRACE, &mut s1).await;
            m1.watch.disconnect(); // the launcher exits
            next
        })
    });
    let success = Next::Exit {
        code: 0,
        reason: String::new(),
    };
    assert_eq!(n0, success);
    assert_eq!(n1, success);
}

#[test]
fn a_machine_that_never_joined_is_named_as_such() {
    let rt = runtime();
    let store = StoreServer::start("127.0.0.1:0".parse().unwrap(), TOKEN.into(), 0).unwrap();
    let mut m0 = MachineLink::join(store.local_addr(), TOKEN, 0, 2, "host-a", WAIT).unwrap();
    m0.report_end(0, LocalEnd::Failed("rank 0 exited with code 1".into()))
        .unwrap();
    let reason = verdict_of_machine_0_alone(&rt, &store, &mut m0);
    assert!(reason.contains("machine 1 never joined"), "{reason}");
}

#[test]
fn a_second_launcher_of_one_machine_rank_is_refused_and_the_first_keeps_its_place() {
    let rt = runtime();
    let (store, mut m0, _m1) = two_machines();
    let e = MachineLink::join(store.local_addr(), TOKEN, 1, 2, "host-c", WAIT).unwrap_err();
    assert!(
        e.contains("machine 1 has already joined from host-b"),
        "{e}"
    );
    // The refused launcher's join and departure do not disturb the group.
    rt.block_on(async {
        while !m0.hosts.contains_key(&1) {
            m0.next_event().await;
        }
    });
    std::thread::sleep(Duration::from_millis(200));
    rt.block_on(async {
        while let Ok(Followed::Event(e)) = m0.events.try_recv() {
            m0.absorb(e);
        }
    });
    assert_eq!(m0.hosts.get(&1).map(String::as_str), Some("host-b"));
    assert!(!m0.departed.contains(&1));
    assert_eq!(m0.reason_to_stop(0), None);
}

#[test]
fn a_launcher_cannot_join_a_running_job() {
    let (store, mut m0, mut m1) = two_machines();
    m0.report_end(0, LocalEnd::Success).unwrap();
    let e = MachineLink::join(store.local_addr(), TOKEN, 1, 2, "host-b2", WAIT).unwrap_err();
    assert!(e.contains("already running"), "{e}");
    let _ = m1.report_end(0, LocalEnd::Success);
}

#[test]
fn machine_0_abandoning_the_job_tells_the_others_before_it_exits() {
    let rt = runtime();
    let (_store, mut m0, mut m1) = two_machines();
    // Machine 0 stops at once (a signal before its workers started): nothing absorbed yet.
    let reason = rt.block_on(async {
        let machine_1 = async {
            let reason = tokio::time::timeout(WAIT, m1.stop_reason(0))
                .await
                .expect("machine 1 hears why");
            m1.watch.disconnect(); // the launcher exits
            reason
        };
        let (_, reason) = tokio::join!(
            m0.abandon(0, LocalEnd::Interrupted(libc::SIGINT)),
            machine_1
        );
        reason
    });
    assert!(
        reason.contains("machine 0 (host-a) received SIGINT"),
        "{reason}"
    );
}

#[test]
fn a_machine_that_leaves_is_never_restarted() {
    let rt = runtime();
    let (store, mut m0, mut m1) = two_machines();
    rt.block_on(m1.abandon(0, LocalEnd::Failed("cannot start the workers".into())));
    m0.report_end(0, LocalEnd::Stopped("machine 1 failed".into()))
        .unwrap();
    let next = rt.block_on(async {
        let mut s0 = SignalWatch::silent();
        m0.settle(0, Some(&store), 3, GRACE, &mut s0).await
    });
    let Next::Exit { code: 1, reason } = next else {
        panic!("{next:?}")
    };
    assert!(
        reason.contains("machine 1 (host-b)'s launcher left the job: failed: cannot start"),
        "{reason}"
    );
    assert_eq!(store.service().generation(), 0);
}
