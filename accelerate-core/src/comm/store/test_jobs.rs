//! A job of several ranks for tests: threads, each a rank with its own client of one store.

use std::time::Duration;

use super::{StoreServer, TcpStoreClient};

/// Runs `f(rank, store client)` on `world` threads, each with its own client of one fresh store
/// (token `token`); returns the results by rank. The jobs of the tests that need several ranks
/// are built on it.
pub(crate) fn on_store_clients<R: Send>(
    world: usize,
    token: &str,
    f: impl Fn(usize, &TcpStoreClient) -> R + Sync,
) -> Vec<R> {
    let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), token.into(), 0).unwrap();
    let addr = server.local_addr();
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let f = &f;
                scope.spawn(move || {
                    let store =
                        TcpStoreClient::connect(addr, token, 0, rank, Duration::from_secs(10))
                            .unwrap();
                    f(rank, &store)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}
