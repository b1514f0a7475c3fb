//! The rendezvous store: a token-authenticated TCP key-value store (set, get, wait, add).
//!
//! Wire format (little-endian): the client opens with `ZRST`, a u32 token length and the
//! token; the server answers one byte (0 accepted, 1 refused, 2 full: it serves its maximum of
//! clients), closing after 1 and 2; a client that gets any other byte has dialled another
//! service. Requests are an op byte followed by length-prefixed strings/bytes; each gets one
//! status byte and a payload. A `get` or `wait` that times out answers status 1 and the keys
//! still missing as a u32 count of ranges, then each range's first and past-the-end index
//! into the keys asked for (u32 each): a few bytes however many keys are missing.
//!
//! Every message has a deadline for arriving whole ([`StoreLimits`]): the handshake a few
//! seconds, a request (from its first byte) 30 s; the time a `wait` or `get` then spends
//! waiting for keys is its own, asked for in the request.

mod client;
mod resolve;
mod server;

use std::io::Read;
use std::time::Duration;

pub use client::StoreClient;
pub(crate) use resolve::{resolve, Unresolved};
pub use server::StoreServer;

const MAGIC: &[u8; 4] = b"ZRST";
const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_WAIT: u8 = 3;
const OP_ADD: u8 = 4;
const ANS_OK: u8 = 0;
const ANS_REFUSED: u8 = 1;
const ANS_BUSY: u8 = 2;
const MAX_FIELD: usize = 64 << 20;

/// Resource limits of a [`StoreServer`]: what a connection may cost before and after it
/// presents the token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreLimits {
    /// Time for a connection's whole handshake (magic and token), from its accept; a slower
    /// one is closed. Default 3 s.
    pub handshake: Duration,
    /// Time for a request to arrive whole, from its first byte; a slower one closes the
    /// connection. Writing a reply has the same limit. Default 30 s.
    pub request: Duration,
    /// Connections in their handshake at once (they cost a descriptor, no thread); a new one
    /// past it drops the oldest. Default 128.
    pub max_pending: usize,
    /// Authenticated clients served at once (a thread each); a client past it is answered
    /// "full" and closed. Default 8192.
    pub max_clients: usize,
}

impl Default for StoreLimits {
    fn default() -> StoreLimits {
        StoreLimits {
            handshake: Duration::from_secs(3),
            request: Duration::from_secs(30),
            max_pending: 128,
            max_clients: 8192,
        }
    }
}

/// Address to bind the store to for `MASTER_ADDR`: loopback stays loopback, anything else
/// listens on every interface (clients still need the token).
pub(crate) fn bind_addr_for(master_addr: &str, port: u16) -> String {
    let loopback = master_addr == "localhost"
        || master_addr
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    if loopback {
        format!("{master_addr}:{port}")
    } else {
        format!("0.0.0.0:{port}")
    }
}

fn read_u32(s: &mut impl Read) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    s.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn read_u64(s: &mut impl Read) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    s.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

fn read_bytes(s: &mut impl Read) -> std::io::Result<Vec<u8>> {
    let n = read_u32(s)? as usize;
    if n > MAX_FIELD {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("field of {n} bytes is over the store's {MAX_FIELD}-byte limit"),
        ));
    }
    let mut v = vec![0u8; n];
    s.read_exact(&mut v)?;
    Ok(v)
}

fn read_str(s: &mut impl Read) -> std::io::Result<String> {
    String::from_utf8(read_bytes(s)?)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "key is not UTF-8"))
}

/// Writes `ranges` of key indices as the reply of a timed-out wait.
fn put_ranges(out: &mut Vec<u8>, ranges: &[std::ops::Range<usize>]) {
    out.extend_from_slice(&(ranges.len() as u32).to_le_bytes());
    for r in ranges {
        out.extend_from_slice(&(r.start as u32).to_le_bytes());
        out.extend_from_slice(&(r.end as u32).to_le_bytes());
    }
}

/// Reads what [`put_ranges`] wrote, refusing ranges outside `0..asked` or out of order.
fn read_ranges(s: &mut impl Read, asked: usize) -> std::io::Result<Vec<std::ops::Range<usize>>> {
    let n = read_u32(s)? as usize;
    let bad = || {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "malformed list of missing keys",
        )
    };
    if n > asked {
        return Err(bad());
    }
    let mut out: Vec<std::ops::Range<usize>> = Vec::with_capacity(n);
    for _ in 0..n {
        let (a, b) = (read_u32(s)? as usize, read_u32(s)? as usize);
        if a >= b || b > asked || out.last().is_some_and(|p| p.end > a) {
            return Err(bad());
        }
        out.push(a..b);
    }
    Ok(out)
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    out.extend_from_slice(b);
}

#[cfg(test)]
// Lists of one range of ranks or keys are what these tests mean.
#[allow(clippy::single_range_in_vec_init)]
mod tests {
    use super::*;
    use crate::Error;
    use std::net::TcpListener;
    use std::time::Instant;

    fn server() -> (StoreServer, String) {
        let s = StoreServer::start("127.0.0.1:0", "secret").unwrap();
        let a = format!("127.0.0.1:{}", s.port());
        (s, a)
    }

    #[test]
    fn set_get_wait_and_add() {
        let (_s, addr) = server();
        let c = StoreClient::connect(&addr, "secret", Duration::from_secs(5)).unwrap();
        c.set("a", b"hello").unwrap();
        assert_eq!(c.get("a").unwrap(), b"hello");
        assert_eq!(c.add("n", 5).unwrap(), 5);
        assert_eq!(c.add("n", -2).unwrap(), 3);
        let e = c.wait(&["a", "b"], Duration::from_millis(200)).unwrap_err();
        assert!(
            matches!(&e, Error::StoreTimeout { missing, names, .. } if missing == &[1..2] && names == &["b".to_string()]),
            "{e}"
        );
        // a get blocks until another client sets the key
        let addr2 = addr.clone();
        let t = std::thread::spawn(move || {
            let c2 = StoreClient::connect(&addr2, "secret", Duration::from_secs(5)).unwrap();
            std::thread::sleep(Duration::from_millis(100));
            c2.set("late", b"x").unwrap();
        });
        assert_eq!(c.get("late").unwrap(), b"x");
        t.join().unwrap();
    }

    #[test]
    fn a_wait_too_long_for_the_clock_is_served() {
        let (_s, addr) = server();
        // Connecting and waiting this long once overflowed `now + timeout`, on both sides.
        let c = StoreClient::connect(&addr, "secret", Duration::MAX).unwrap();
        c.set("a", b"x").unwrap();
        assert_eq!(c.get("a").unwrap(), b"x");
        c.wait(&["a"], Duration::MAX).unwrap();
    }

    #[test]
    fn wrong_token_is_refused() {
        let (_s, addr) = server();
        let e = StoreClient::connect(&addr, "guess", Duration::from_secs(5)).unwrap_err();
        assert!(matches!(e, Error::StoreRefused { .. }), "{e}");
        assert!(e.to_string().contains("wrong job token"));
    }

    #[test]
    fn unreachable_master_is_reported_within_the_deadline() {
        // Bind then drop to get a port that nobody listens on.
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let t = Instant::now();
        let e = StoreClient::connect(
            &format!("127.0.0.1:{port}"),
            "x",
            Duration::from_millis(300),
        )
        .unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(3));
        assert!(e.to_string().contains("cannot connect within"), "{e}");
    }

    #[test]
    fn many_concurrent_clients_count_and_see_each_other() {
        let (_s, addr) = server();
        let n = 32;
        let threads: Vec<_> = (0..n)
            .map(|i| {
                let addr = addr.clone();
                std::thread::spawn(move || {
                    let c = StoreClient::connect(&addr, "secret", Duration::from_secs(10)).unwrap();
                    for _ in 0..10 {
                        c.add("counter", 1).unwrap();
                    }
                    c.set(&format!("k{i}"), format!("v{i}").as_bytes()).unwrap();
                    let keys: Vec<String> = (0..n).map(|j| format!("k{j}")).collect();
                    let refs: Vec<&str> = keys.iter().map(|s| s.as_str()).collect();
                    c.wait(&refs, Duration::from_secs(10)).unwrap();
                    for j in 0..n {
                        assert_eq!(c.get(&format!("k{j}")).unwrap(), format!("v{j}").as_bytes());
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let c = StoreClient::connect(&addr, "secret", Duration::from_secs(5)).unwrap();
        assert_eq!(c.add("counter", 0).unwrap(), 10 * n as i64);
    }
}
