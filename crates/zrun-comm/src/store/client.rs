//! The store's client: one connection, one request at a time.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::resolve::{resolve, Unresolved};
use super::{put_bytes, read_bytes, read_ranges};
use super::{ANS_BUSY, ANS_OK, ANS_REFUSED, MAGIC, OP_ADD, OP_GET, OP_SET, OP_WAIT};
use crate::error::NAMED_KEYS;
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
    /// flooded), a "full" answer or a host name the resolver cannot look up yet is retried
    /// like a refused connect; a wrong token fails at once with [`Error::StoreRefused`], a
    /// service that is not a zrun store with [`Error::NotAStore`], and a host name that does
    /// not exist with [`Error::StoreHost`].
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
                Err(Attempt::Foreign(answer)) => {
                    return Err(Error::NotAStore {
                        addr: addr.into(),
                        answer,
                    })
                }
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

    /// Reads the missing keys of a timed-out `get` or `wait` of `asked` (ranges of indices,
    /// see the module's wire format) into [`Error::StoreTimeout`].
    fn missing(
        &self,
        s: &mut TcpStream,
        asked: &[&str],
        timeout: Duration,
    ) -> std::io::Result<Result<Vec<u8>, Error>> {
        // Buffered: a list of many ranges in a few reads (nothing follows the reply).
        let missing = read_ranges(&mut std::io::BufReader::new(&*s), asked.len())?;
        let names = missing
            .iter()
            .flat_map(|r| r.clone())
            .take(NAMED_KEYS)
            .map(|i| asked[i].to_string())
            .collect();
        Ok(Err(Error::StoreTimeout {
            addr: self.addr.clone(),
            missing,
            names,
            asked: asked.len(),
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
    /// Something answered that is not a zrun store: the first bytes it sent.
    Foreign(String),
    /// Anything else (socket options).
    Failed(Error),
}

/// `d` in whole milliseconds, as a request carries it (`u64::MAX` for a longer `d`).
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The first bytes a service that is not a zrun store sent (`first`, then what arrives within
/// a moment), as printable ASCII for a message.
fn answer_of(stream: &mut TcpStream, first: u8) -> String {
    let mut bytes = vec![first];
    let mut more = [0u8; 31];
    if stream
        .set_read_timeout(Some(Duration::from_millis(200)))
        .is_ok()
    {
        if let Ok(n) = stream.read(&mut more) {
            bytes.extend_from_slice(&more[..n]);
        }
    }
    bytes
        .iter()
        .map(|&b| match b {
            b' '..=b'~' => b as char,
            _ => '.',
        })
        .collect()
}

/// One TCP connect and handshake.
fn attempt(addr: &str, token: &str, timeout: Duration) -> Result<TcpStream, Attempt> {
    let sa = resolve(addr).map_err(|e| match e {
        Unresolved::Passing(detail) => Attempt::Retry(detail),
        Unresolved::Unknown { host, detail } => Attempt::Failed(Error::StoreHost {
            addr: addr.into(),
            host,
            detail,
        }),
    })?;
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
    let wait = timeout.max(Duration::from_secs(1));
    stream.set_read_timeout(Some(wait)).map_err(failed)?;
    let mut hello = MAGIC.to_vec();
    put_bytes(&mut hello, token.as_bytes());
    let dropped = |e: std::io::Error| {
        Attempt::Retry(match e.kind() {
            // A zrun store answers or closes within its handshake limit (3 s by default).
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => format!(
                "no answer to the handshake within {} s: the store is overloaded, or another service that does not speak zrun's protocol listens on that port (then pick another MASTER_PORT)",
                wait.as_secs_f64()
            ),
            _ => format!(
                "the store closed the connection during the handshake ({e}); it may be flooded with connections"
            ),
        })
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
        ANS_REFUSED => return Err(Attempt::Refused),
        first => return Err(Attempt::Foreign(answer_of(&mut stream, first))),
    }
    stream.set_read_timeout(None).map_err(failed)?;
    Ok(stream)
}
