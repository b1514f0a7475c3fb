//! The rendezvous store: a token-authenticated TCP key-value store (set, get, wait, add).
//!
//! Wire format (little-endian): the client opens with `ZRST`, a u32 token length and the
//! token; the server answers one byte (0 accepted, 1 refused, then closes). Requests are an op
//! byte followed by length-prefixed strings/bytes; each gets one status byte and a payload.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::Error;

const MAGIC: &[u8; 4] = b"ZRST";
const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_WAIT: u8 = 3;
const OP_ADD: u8 = 4;
const MAX_FIELD: usize = 64 << 20;

type Shared = Arc<(Mutex<HashMap<String, Vec<u8>>>, Condvar)>;

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

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    out.extend_from_slice(b);
}

/// Constant-time comparison, so the token cannot be guessed byte by byte from timing.
fn same_token(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The store's server: one thread accepting, one per client.
#[derive(Debug)]
pub struct StoreServer {
    port: u16,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

impl StoreServer {
    /// Listens on `bind` (`host:port`, port 0 picks a free one) and serves clients that
    /// present `token`.
    pub fn start(bind: &str, token: &str) -> Result<StoreServer, Error> {
        let listener = TcpListener::bind(bind).map_err(|e| Error::Store {
            addr: bind.into(),
            op: "listen",
            detail: format!("{e}; is another job using this port? pick another MASTER_PORT"),
        })?;
        let port = listener.local_addr().map(|a| a.port()).unwrap_or(0);
        let stop = Arc::new(AtomicBool::new(false));
        let shared: Shared = Arc::new((Mutex::new(HashMap::new()), Condvar::new()));
        let token = token.as_bytes().to_vec();
        let stop2 = stop.clone();
        let accept = std::thread::Builder::new()
            .name("zrun-store".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if stop2.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(conn) = conn else { continue };
                    let (shared, token) = (shared.clone(), token.clone());
                    let _ = std::thread::Builder::new()
                        .name("zrun-store-client".into())
                        .spawn(move || serve(conn, &shared, &token));
                }
            })
            .map_err(|e| Error::Store {
                addr: bind.into(),
                op: "serve",
                detail: e.to_string(),
            })?;
        Ok(StoreServer {
            port,
            stop,
            accept: Some(accept),
        })
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop.
        let _ = TcpStream::connect_timeout(
            &([127, 0, 0, 1], self.port).into(),
            Duration::from_millis(200),
        );
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

fn serve(mut s: TcpStream, shared: &Shared, token: &[u8]) {
    let _ = s.set_nodelay(true);
    let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
    let mut magic = [0u8; 4];
    if s.read_exact(&mut magic).is_err() || &magic != MAGIC {
        return;
    }
    let ok = match read_u32(&mut s) {
        Ok(n) if n as usize <= 4096 => {
            let mut t = vec![0u8; n as usize];
            s.read_exact(&mut t).is_ok() && same_token(&t, token)
        }
        _ => false,
    };
    if !ok {
        let _ = s.write_all(&[1]);
        let _ = s.shutdown(Shutdown::Both);
        return;
    }
    if s.write_all(&[0]).is_err() {
        return;
    }
    let _ = s.set_read_timeout(None);
    while let Ok(reply) = handle(&mut s, shared) {
        if s.write_all(&reply).is_err() {
            return;
        }
    }
}

/// Reads one request and computes its reply.
fn handle(s: &mut TcpStream, shared: &Shared) -> std::io::Result<Vec<u8>> {
    let mut op = [0u8; 1];
    s.read_exact(&mut op)?;
    let (map, cv) = &**shared;
    let lock = || map.lock().unwrap_or_else(|p| p.into_inner());
    let mut out = Vec::new();
    match op[0] {
        OP_SET => {
            let key = read_str(s)?;
            let val = read_bytes(s)?;
            lock().insert(key, val);
            cv.notify_all();
            out.push(0);
        }
        OP_GET | OP_WAIT => {
            let keys = if op[0] == OP_GET {
                vec![read_str(s)?]
            } else {
                let n = read_u32(s)? as usize;
                (0..n).map(|_| read_str(s)).collect::<Result<Vec<_>, _>>()?
            };
            let deadline = Instant::now() + Duration::from_millis(read_u64(s)?);
            let mut g = lock();
            loop {
                let missing: Vec<&String> = keys.iter().filter(|k| !g.contains_key(*k)).collect();
                if missing.is_empty() {
                    out.push(0);
                    if op[0] == OP_GET {
                        put_bytes(&mut out, &g[&keys[0]]);
                    }
                    break;
                }
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    out.push(1);
                    out.extend_from_slice(&(missing.len() as u32).to_le_bytes());
                    for k in missing {
                        put_bytes(&mut out, k.as_bytes());
                    }
                    break;
                }
                g = cv
                    .wait_timeout(g, left)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
        }
        OP_ADD => {
            let key = read_str(s)?;
            let delta = read_u64(s)? as i64;
            let mut g = lock();
            let cur = g
                .get(&key)
                .and_then(|v| <[u8; 8]>::try_from(v.as_slice()).ok())
                .map(i64::from_le_bytes)
                .unwrap_or(0);
            let new = cur.wrapping_add(delta);
            g.insert(key, new.to_le_bytes().to_vec());
            drop(g);
            cv.notify_all();
            out.push(0);
            out.extend_from_slice(&new.to_le_bytes());
        }
        other => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("unknown store op {other}"),
            ))
        }
    }
    Ok(out)
}

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
    pub fn connect(addr: &str, token: &str, timeout: Duration) -> Result<StoreClient, Error> {
        let deadline = Instant::now() + timeout;
        let mut stream = loop {
            let attempt = addr
                .to_socket_addrs()
                .map_err(|e| e.to_string())
                .and_then(|mut it| {
                    it.next()
                        .ok_or_else(|| "address resolves to nothing".into())
                })
                .and_then(|sa| {
                    TcpStream::connect_timeout(&sa, Duration::from_secs(2))
                        .map_err(|e| e.to_string())
                });
            let last = match attempt {
                Ok(s) => break s,
                Err(e) => e,
            };
            if Instant::now() >= deadline {
                return Err(Error::StoreUnreachable {
                    addr: addr.into(),
                    timeout,
                    detail: last,
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let io = |op: &'static str| {
            let addr = addr.to_string();
            move |e: std::io::Error| Error::Store {
                addr: addr.clone(),
                op,
                detail: e.to_string(),
            }
        };
        stream.set_nodelay(true).map_err(io("connect"))?;
        stream
            .set_read_timeout(Some(timeout.max(Duration::from_secs(1))))
            .map_err(io("connect"))?;
        let mut hello = MAGIC.to_vec();
        put_bytes(&mut hello, token.as_bytes());
        stream.write_all(&hello).map_err(io("connect"))?;
        let mut ans = [0u8; 1];
        match stream.read_exact(&mut ans) {
            Ok(()) if ans[0] == 0 => {}
            Ok(()) => return Err(Error::StoreRefused { addr: addr.into() }),
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return Err(Error::StoreRefused { addr: addr.into() })
            }
            Err(e) => return Err(io("connect")(e)),
        }
        stream.set_read_timeout(None).map_err(io("connect"))?;
        Ok(StoreClient {
            addr: addr.into(),
            conn: Mutex::new(stream),
            timeout,
        })
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
        s.set_read_timeout(Some(wait + Duration::from_secs(10)))
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
        req.extend_from_slice(&(self.timeout.as_millis() as u64).to_le_bytes());
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
        req.extend_from_slice(&(timeout.as_millis() as u64).to_le_bytes());
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

#[cfg(test)]
mod tests {
    use super::*;

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
            matches!(&e, Error::StoreTimeout { missing, .. } if missing == &["b".to_string()]),
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
