//! Loopback ports for the stores that a test's ranks host themselves.

/// A TCP port on loopback that was free a moment ago (the listener that found it is closed), for
/// a store that a test's ranks host themselves.
pub fn free_port() -> u16 {
    free_ports(1)
}

/// The first of `n` consecutive loopback ports that were free a moment ago and that no other test
/// of this process has been given: tests run in parallel threads, and two that found the same
/// free port (or one the other's store takes at port + 1) would join each other's jobs.
pub fn free_ports(n: u16) -> u16 {
    static GIVEN: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let first = std::net::TcpListener::bind("127.0.0.1:0")
            .expect("binding a loopback port")
            .local_addr()
            .expect("a bound address")
            .port();
        let Some(last) = first.checked_add(n - 1) else {
            continue;
        };
        let ports = first..=last;
        let free = ports.clone().all(|p| {
            !given.contains(&p)
                && (p == first || std::net::TcpListener::bind(("127.0.0.1", p)).is_ok())
        });
        if free {
            given.extend(ports);
            return first;
        }
    }
}
