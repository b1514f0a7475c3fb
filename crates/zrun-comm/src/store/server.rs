//! The store's server: one thread accepts connections and reads every handshake (non-blocking,
//! polled, each under a whole-handshake deadline); only an authenticated client gets a thread.
//!
//! What an untrusted connection can cost: no thread, one descriptor and at most a few KiB, for
//! at most [`StoreLimits::handshake`]; past [`StoreLimits::max_pending`] handshakes in flight
//! the oldest is dropped. When accept fails for want of descriptors or memory the loop drops
//! the oldest handshake and pauses accepting (10 ms doubling to 500 ms) instead of spinning,
//! and resumes by itself once descriptors are free.

use std::collections::HashMap;
use std::io::{BufReader, ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{put_bytes, put_ranges, read_bytes, read_str, read_u32, read_u64, StoreLimits};
use super::{ANS_BUSY, ANS_OK, ANS_REFUSED, MAGIC, OP_ADD, OP_GET, OP_SET, OP_WAIT};
use crate::greet::{self, Greeting};
use crate::Error;

type Shared = Arc<(Mutex<HashMap<String, Vec<u8>>>, Condvar)>;

/// Stack of a client thread: requests are parsed into heap buffers, so little is needed.
const CLIENT_STACK: usize = 256 << 10;
/// Longest pause of the accept loop after running out of descriptors.
const MAX_PAUSE: Duration = Duration::from_millis(500);
/// Longest single poll, so that a stop request is seen even if the wake-up connect fails.
const TICK: Duration = Duration::from_millis(200);

/// The store's server: one thread for accepting and handshakes, one per authenticated client.
#[derive(Debug)]
pub struct StoreServer {
    port: u16,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

impl StoreServer {
    /// Listens on `bind` (`host:port`, port 0 picks a free one) and serves clients that
    /// present `token`, with the default [`StoreLimits`].
    pub fn start(bind: &str, token: &str) -> Result<StoreServer, Error> {
        StoreServer::start_with(bind, token, StoreLimits::default())
    }

    /// [`StoreServer::start`] with explicit resource limits.
    pub fn start_with(bind: &str, token: &str, limits: StoreLimits) -> Result<StoreServer, Error> {
        let err = |op: &'static str, detail: String| Error::Store {
            addr: bind.into(),
            op,
            detail,
        };
        let listener = TcpListener::bind(bind).map_err(|e| {
            err(
                "listen",
                format!("{e}; is another job using this port? pick another MASTER_PORT"),
            )
        })?;
        listener
            .set_nonblocking(true)
            .map_err(|e| err("listen", e.to_string()))?;
        let port = listener.local_addr().map(|a| a.port()).unwrap_or(0);
        let stop = Arc::new(AtomicBool::new(false));
        let mut acceptor = Acceptor {
            listener,
            token: token.as_bytes().to_vec(),
            limits,
            shared: Arc::new((Mutex::new(HashMap::new()), Condvar::new())),
            clients: Arc::new(AtomicUsize::new(0)),
            pending: Vec::new(),
            stop: stop.clone(),
        };
        let accept = std::thread::Builder::new()
            .name("zrun-store".into())
            .spawn(move || acceptor.run())
            .map_err(|e| err("serve", e.to_string()))?;
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
        // Wake the accept loop (it also looks at `stop` every TICK).
        let _ = TcpStream::connect_timeout(
            &([127, 0, 0, 1], self.port).into(),
            Duration::from_millis(200),
        );
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

/// State of the accepting thread.
struct Acceptor {
    listener: TcpListener,
    token: Vec<u8>,
    limits: StoreLimits,
    shared: Shared,
    /// Authenticated clients being served.
    clients: Arc<AtomicUsize>,
    /// Handshakes in flight, oldest first.
    pending: Vec<Greeting>,
    stop: Arc<AtomicBool>,
}

impl Acceptor {
    fn run(&mut self) {
        let mut paused_until: Option<Instant> = None;
        let mut pause = Duration::from_millis(10);
        while !self.stop.load(Ordering::SeqCst) {
            let now = Instant::now();
            self.pending.retain(|g| g.deadline > now);
            if paused_until.is_some_and(|t| t <= now) {
                paused_until = None;
            }
            let listening = paused_until.is_none();
            let mut fds: Vec<libc::pollfd> = Vec::with_capacity(self.pending.len() + 1);
            if listening {
                fds.push(greet::readable(&self.listener));
            }
            fds.extend(self.pending.iter().map(|g| greet::readable(&g.stream)));
            let mut wake = now + TICK;
            if let Some(t) = paused_until {
                wake = wake.min(t);
            }
            if let Some(t) = self.pending.iter().map(|g| g.deadline).min() {
                wake = wake.min(t);
            }
            if greet::poll(&mut fds, wake.saturating_duration_since(now)).is_err() {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            let (lfd, gfds) = if listening {
                (Some(fds[0]), &fds[1..])
            } else {
                (None, &fds[..])
            };
            // Handshakes first: the connections accepted below are not in `fds`.
            let ready: Vec<bool> = gfds.iter().map(|p| p.revents != 0).collect();
            self.advance_handshakes(&ready);
            if lfd.is_some_and(|p| p.revents != 0) {
                match self.accept_all() {
                    Ok(()) => pause = Duration::from_millis(10),
                    Err(e) => {
                        // Free a descriptor now (the oldest handshake is the likeliest to be
                        // idle) and stop polling the listener for a while: it stays readable
                        // while the connection it cannot hand over waits in the backlog.
                        if !self.pending.is_empty() {
                            self.pending.remove(0);
                        }
                        tracing::warn!(
                            "rendezvous store: accept failed ({e}); pausing {pause:?} until descriptors are free"
                        );
                        paused_until = Some(Instant::now() + pause);
                        pause = (pause * 2).min(MAX_PAUSE);
                    }
                }
            }
        }
    }

    /// Accepts every connection waiting in the backlog; an error means "out of resources".
    fn accept_all(&mut self) -> std::io::Result<()> {
        // Bounded, so a flood cannot keep the handshakes already read from being finished.
        for _ in 0..256 {
            match self.listener.accept() {
                Ok((s, from)) => {
                    let deadline = crate::deadline_in(self.limits.handshake);
                    let Ok(g) = Greeting::new(s, from, MAGIC, 8, deadline) else {
                        continue;
                    };
                    if self.pending.len() >= self.limits.max_pending.max(1) {
                        self.pending.remove(0);
                    }
                    self.pending.push(g);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                Err(e) if greet::out_of_resources(&e) => return Err(e),
                // ECONNABORTED and the like concern one connection only.
                Err(_) => {}
            }
        }
        Ok(())
    }

    /// Reads what arrived on the handshakes flagged `ready`; finished ones are answered.
    fn advance_handshakes(&mut self, ready: &[bool]) {
        for finished in greet::advance(&mut self.pending, ready) {
            match finished {
                Err(g) => refuse(g.stream),
                Ok(g) if greet::same_token(g.token(), &self.token) => self.admit(g),
                Ok(g) => {
                    tracing::debug!(from = %g.from, "rendezvous store: refused a wrong token");
                    refuse(g.stream);
                }
            }
        }
    }

    /// Serves an authenticated connection on its own thread, within the client limit.
    fn admit(&mut self, g: Greeting) {
        let Ok(mut s) = g.into_stream() else { return };
        if self.clients.fetch_add(1, Ordering::SeqCst) >= self.limits.max_clients {
            self.clients.fetch_sub(1, Ordering::SeqCst);
            let _ = s.write_all(&[ANS_BUSY]);
            let _ = s.shutdown(Shutdown::Both);
            return;
        }
        let (shared, clients, limits) = (self.shared.clone(), self.clients.clone(), self.limits);
        let spawned = std::thread::Builder::new()
            .name("zrun-store-client".into())
            .stack_size(CLIENT_STACK)
            .spawn(move || {
                serve(s, &shared, limits);
                clients.fetch_sub(1, Ordering::SeqCst);
            });
        if spawned.is_err() {
            self.clients.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Answers "refused" (when the socket takes it at once) and closes.
fn refuse(mut s: TcpStream) {
    let _ = s.write(&[ANS_REFUSED]);
    let _ = s.shutdown(Shutdown::Both);
}

/// A reader whose reads all end at one deadline (`None`: none): a message must arrive
/// whole before it.
struct Deadline<'a> {
    s: &'a TcpStream,
    at: Option<Instant>,
}

impl Read for Deadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let limit = match self.at {
            None => None,
            Some(at) => {
                let left = at.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(std::io::Error::new(
                        ErrorKind::TimedOut,
                        "request did not arrive whole before its deadline",
                    ));
                }
                Some(left)
            }
        };
        self.s.set_read_timeout(limit)?;
        let mut r: &TcpStream = self.s;
        r.read(buf)
    }
}

/// Bytes of a client's read buffer: a request of many keys is read in a few large reads,
/// not two small ones per key.
const READ_BUFFER: usize = 64 << 10;

/// Serves one authenticated client until it disconnects, misbehaves or is too slow.
fn serve(s: TcpStream, shared: &Shared, limits: StoreLimits) {
    let _ = s.set_nodelay(true);
    let _ = s.set_write_timeout(Some(limits.request));
    let mut out: &TcpStream = &s;
    if out.write_all(&[ANS_OK]).is_err() {
        return;
    }
    let mut body = BufReader::with_capacity(READ_BUFFER, Deadline { s: &s, at: None });
    loop {
        // Between requests a client may stay quiet for the whole job.
        body.get_mut().at = None;
        let mut op = [0u8; 1];
        if body.read_exact(&mut op).is_err() {
            return;
        }
        body.get_mut().at = Some(crate::deadline_in(limits.request));
        let Ok(reply) = handle(op[0], &mut body, shared) else {
            let _ = s.shutdown(Shutdown::Both);
            return;
        };
        if out.write_all(&reply).is_err() {
            return;
        }
    }
}

/// The indices of `keys` from `first` on that are not `present`, as sorted, disjoint ranges.
fn missing_ranges(
    keys: &[String],
    first: usize,
    present: impl Fn(&String) -> bool,
) -> Vec<std::ops::Range<usize>> {
    let mut out: Vec<std::ops::Range<usize>> = Vec::new();
    for (i, k) in keys.iter().enumerate().skip(first) {
        if present(k) {
            continue;
        }
        match out.last_mut() {
            Some(r) if r.end == i => r.end = i + 1,
            _ => out.push(i..i + 1),
        }
    }
    out
}

/// Reads the rest of request `op` and computes its reply.
fn handle(op: u8, s: &mut impl Read, shared: &Shared) -> std::io::Result<Vec<u8>> {
    let (map, cv) = &**shared;
    let lock = || map.lock().unwrap_or_else(|p| p.into_inner());
    let mut out = Vec::new();
    match op {
        OP_SET => {
            let key = read_str(s)?;
            let val = read_bytes(s)?;
            lock().insert(key, val);
            cv.notify_all();
            out.push(0);
        }
        OP_GET | OP_WAIT => {
            let keys = if op == OP_GET {
                vec![read_str(s)?]
            } else {
                let n = read_u32(s)? as usize;
                (0..n).map(|_| read_str(s)).collect::<Result<Vec<_>, _>>()?
            };
            // The client's wait, whatever its size, must not overflow the clock.
            let deadline = crate::deadline_in(Duration::from_millis(read_u64(s)?));
            let mut g = lock();
            // Keys are never removed: those before `first` were all seen set.
            let mut first = 0;
            loop {
                while first < keys.len() && g.contains_key(&keys[first]) {
                    first += 1;
                }
                if first == keys.len() {
                    out.push(0);
                    if op == OP_GET {
                        put_bytes(&mut out, &g[&keys[0]]);
                    }
                    break;
                }
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    out.push(1);
                    put_ranges(
                        &mut out,
                        &missing_ranges(&keys, first, |k| g.contains_key(k)),
                    );
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
                ErrorKind::InvalidData,
                format!("unknown store op {other}"),
            ))
        }
    }
    Ok(out)
}
