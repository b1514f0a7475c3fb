//! The store's client: one connection, one request at a time.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{put_bytes, read_bytes, read_str, read_u32};
use super::{ANS_BUSY, ANS_OK, MAGIC, OP_ADD, OP_GET, OP_SET, OP_WAIT};
use crate::Error;

/// A connection to the store. Methods are safe to call from several threads (one request at a
/// time on the connection).
#[derive(Debug)]
pub struct StoreClient {
    addr: String,
    conn: Mutex<TcpStream>,
    timeout: Duration,
}

impl StoreClient {
    /// Connects to `addr` (`host:port`), retrying until `timeout`, and presents `token`.
    /// `timeout` is also the default deadline of [`StoreClient::get`].
    ///
    /// A connection the store closes before answering (it drops the oldest handshakes when
    /// flooded) or a "full" answer is retried like a refused connect; a wrong token fails at
    /// once with [`Error::StoreRefused`].
    pub fn connect(addr: &str, token: &str, timeout: Duration) -> Result<StoreClient, Error> {
        let deadline = crate::deadline_in(timeout);
        loop {
            let last = match attempt(addr, token, timeout) {
                Ok(stream) => {
                    return Ok(StoreClient {
                        addr: addr.into(),
                        conn: Mutex::new(stream),
                        timeout,
                    })
                }
                Err(Attempt::Refused) => return Err(Error::StoreRefused { addr: addr.into() }),
                Err(Attempt::Failed(e)) => return Err(e),
                Err(Attempt::Retry(detail)) => detail,
            };
            if Instant::now() >= deadline {
                return Err(Error::StoreUnreachable {
                    addr: addr.into(),
                    timeout,
                    detail: last,
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The local address of this client's connection (the interface that reaches the store).
    pub(crate) fn local_ip(&self) -> Option<std::net::IpAddr> {
        let s = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        s.local_addr().ok().map(|a| a.ip())
    }

    /// `host:port` of the store.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    fn request(
        &self,
        op: &'static str,
        req: &[u8],
        wait: Duration,
        reply: impl FnOnce(&mut TcpStream, u8) -> std::io::Result<Result<Vec<u8>, Error>>,
    ) -> Result<Vec<u8>, Error> {
        let io = |e: std::io::Error| Error::Store {
            addr: self.addr.clone(),
            op,
            detail: format!("{e}; the store (rank 0 or the launcher) may have exited"),
        };
        let mut s = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        s.set_read_timeout(Some(wait.saturating_add(Duration::from_secs(10))))
            .map_err(io)?;
        s.write_all(req).map_err(io)?;
        let mut st = [0u8; 1];
        s.read_exact(&mut st).map_err(io)?;
        reply(&mut s, st[0]).map_err(io)?
    }

    /// Sets `key` to `value`.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<(), Error> {
        let mut req = vec![OP_SET];
        put_bytes(&mut req, key.as_bytes());
        put_bytes(&mut req, value);
        self.request("set", &req, Duration::ZERO, |_, _| Ok(Ok(Vec::new())))
            .map(|_| ())
    }

    /// The value of `key`, waiting for it up to the client's timeout.
    pub fn get(&self, key: &str) -> Result<Vec<u8>, Error> {
        let mut req = vec![OP_GET];
        put_bytes(&mut req, key.as_bytes());
        req.extend_from_slice(&millis(self.timeout).to_le_bytes());
        let keys = [key];
        self.request("get", &req, self.timeout, |s, st| {
            if st == 0 {
                read_bytes(s).map(Ok)
            } else {
                self.missing(s, &keys, self.timeout)
            }
        })
    }

    /// Waits until every key in `keys` is set, or fails with [`Error::StoreTimeout`] naming the
    /// missing ones after `timeout`.
    pub fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), Error> {
        let mut req = vec![OP_WAIT];
        req.extend_from_slice(&(keys.len() as u32).to_le_bytes());
        for k in keys {
            put_bytes(&mut req, k.as_bytes());
        }
        req.extend_from_slice(&millis(timeout).to_le_bytes());
        self.request("wait", &req, timeout, |s, st| {
            if st == 0 {
                Ok(Ok(Vec::new()))
            } else {
                self.missing(s, keys, timeout)
            }
        })
        .map(|_| ())
    }

    fn missing(
        &self,
        s: &mut TcpStream,
        _asked: &[&str],
        timeout: Duration,
    ) -> std::io::Result<Result<Vec<u8>, Error>> {
        let n = read_u32(s)? as usize;
        let missing = (0..n).map(|_| read_str(s)).collect::<Result<Vec<_>, _>>()?;
        Ok(Err(Error::StoreTimeout {
            addr: self.addr.clone(),
            missing,
            timeout,
        }))
    }

    /// Atomically adds `delta` to the counter `key` (absent counts as 0); returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64, Error> {
        let mut req = vec![OP_ADD];
        put_bytes(&mut req, key.as_bytes());
        req.extend_from_slice(&delta.to_le_bytes());
        let v = self.request("add", &req, Duration::ZERO, |s, _| {
            let mut b = [0u8; 8];
            s.read_exact(&mut b)?;
            Ok(Ok(b.to_vec()))
        })?;
        let b: [u8; 8] = v.as_slice().try_into().map_err(|_| Error::Store {
            addr: self.addr.clone(),
            op: "add",
            detail: "malformed reply".into(),
        })?;
        Ok(i64::from_le_bytes(b))
    }
}

/// Why one connection attempt did not give a client.
enum Attempt {
    /// Worth another try before the deadline (no listener yet, dropped while flooded, full).
    Retry(String),
    /// The store answered: wrong token.
    Refused,
    /// Anything else (socket options).
    Failed(Error),
}

/// One TCP connect and handshake.
/// `d` in whole milliseconds, as a request carries it (`u64::MAX` for a longer `d`).
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn attempt(addr: &str, token: &str, timeout: Duration) -> Result<TcpStream, Attempt> {
    let sa = addr
        .to_socket_addrs()
        .map_err(|e| Attempt::Retry(e.to_string()))?
        .next()
        .ok_or_else(|| Attempt::Retry("address resolves to nothing".into()))?;
    let mut stream = TcpStream::connect_timeout(&sa, Duration::from_secs(2))
        .map_err(|e| Attempt::Retry(e.to_string()))?;
    let failed = |e: std::io::Error| {
        Attempt::Failed(Error::Store {
            addr: addr.into(),
            op: "connect",
            detail: e.to_string(),
        })
    };
    stream.set_nodelay(true).map_err(failed)?;
    stream
        .set_read_timeout(Some(timeout.max(Duration::from_secs(1))))
        .map_err(failed)?;
    let mut hello = MAGIC.to_vec();
    put_bytes(&mut hello, token.as_bytes());
    let dropped = |e: std::io::Error| {
        Attempt::Retry(format!(
            "the store closed the connection during the handshake ({e}); it may be flooded with connections"
        ))
    };
    stream.write_all(&hello).map_err(dropped)?;
    let mut ans = [0u8; 1];
    stream.read_exact(&mut ans).map_err(dropped)?;
    match ans[0] {
        ANS_OK => {}
        ANS_BUSY => {
            return Err(Attempt::Retry(
                "the store serves its maximum of clients (StoreLimits::max_clients); stop clients left over from other runs or raise the limit".into(),
            ))
        }
        _ => return Err(Attempt::Refused),
    }
    stream.set_read_timeout(None).map_err(failed)?;
    Ok(stream)
}
