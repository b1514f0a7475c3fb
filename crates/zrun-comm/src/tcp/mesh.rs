//! Socket connections between every pair of ranks, with I/O errors turned into errors that
//! name this rank, the op, the bytes and the peer.

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::greet::{self, Greeting};
use crate::Error;

/// What a running collective is, for error messages.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ctx {
    pub(crate) rank: usize,
    pub(crate) op: &'static str,
    pub(crate) bytes: usize,
    pub(crate) timeout: Duration,
}

impl Ctx {
    pub(crate) fn io(&self, peer: usize, what: &str, e: std::io::Error) -> Error {
        match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => Error::Timeout {
                rank: self.rank,
                op: self.op,
                bytes: self.bytes,
                peer: peer.to_string(),
                timeout: self.timeout,
            },
            _ => Error::PeerLost {
                rank: self.rank,
                op: self.op,
                bytes: self.bytes,
                peer,
                detail: format!("{what}: {e}"),
            },
        }
    }

    pub(crate) fn send(&self, s: &TcpStream, peer: usize, data: &[u8]) -> Result<(), Error> {
        let mut w: &TcpStream = s;
        w.write_all(data).map_err(|e| self.io(peer, "send", e))
    }

    pub(crate) fn recv(&self, s: &TcpStream, peer: usize, buf: &mut [u8]) -> Result<(), Error> {
        let mut r: &TcpStream = s;
        r.read_exact(buf).map_err(|e| {
            if e.kind() == ErrorKind::UnexpectedEof {
                self.io(
                    peer,
                    "receive",
                    std::io::Error::new(ErrorKind::UnexpectedEof, "connection closed by the peer"),
                )
            } else {
                self.io(peer, "receive", e)
            }
        })
    }
}

/// Sets the socket options every peer connection uses.
fn tune(s: &TcpStream, timeout: Duration) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    let size: libc::c_int = 4 << 20;
    for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
        use std::os::fd::AsRawFd;
        // SAFETY: valid fd owned by `s`, pointer to a live c_int of the given size.
        unsafe {
            libc::setsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                &size as *const libc::c_int as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    }
    Ok(())
}

const HELLO: &[u8; 4] = b"ZRPR";

/// Connects every pair of ranks: rank r dials every lower rank and accepts every higher one.
/// Each dialer presents the job token and its rank. Returns one stream per peer (`None` at r).
pub(crate) fn connect_mesh(
    rank: usize,
    listener: TcpListener,
    addrs: &[SocketAddr],
    token: &str,
    timeout: Duration,
) -> Result<Vec<Option<TcpStream>>, Error> {
    let world = addrs.len();
    let deadline = crate::deadline_in(timeout);
    let cerr = |detail: String| Error::Connect { rank, detail };
    let mut peers: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    for (q, addr) in addrs.iter().enumerate().take(rank) {
        let s = loop {
            match TcpStream::connect_timeout(addr, Duration::from_secs(2)) {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => {
                    return Err(cerr(format!(
                        "cannot reach rank {q} at {addr} within {timeout:?}: {e}"
                    )))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        tune(&s, timeout).map_err(|e| cerr(format!("socket options for rank {q}: {e}")))?;
        let mut hello = HELLO.to_vec();
        hello.extend_from_slice(&(rank as u32).to_le_bytes());
        hello.extend_from_slice(&(token.len() as u32).to_le_bytes());
        hello.extend_from_slice(token.as_bytes());
        (&s).write_all(&hello)
            .map_err(|e| cerr(format!("greeting rank {q} at {addr}: {e}")))?;
        peers[q] = Some(s);
    }
    listener
        .set_nonblocking(true)
        .map_err(|e| cerr(format!("listener: {e}")))?;
    let mut greetings = Greetings {
        rank,
        world,
        token: token.as_bytes(),
        pending: Vec::new(),
        cap: MAX_UNKNOWN.max(2 * world),
    };
    let mut missing = world - rank - 1;
    while missing > 0 {
        let now = Instant::now();
        if now >= deadline {
            let absent: Vec<usize> = (rank + 1..world).filter(|&q| peers[q].is_none()).collect();
            return Err(cerr(format!(
                "ranks {absent:?} did not connect within {timeout:?}"
            )));
        }
        greetings.expire(now);
        let mut fds = vec![greet::readable(&listener)];
        fds.extend(greetings.pending.iter().map(|g| greet::readable(&g.stream)));
        let wake = greetings
            .pending
            .iter()
            .map(|g| g.deadline)
            .fold(deadline.min(now + Duration::from_millis(100)), Instant::min);
        greet::poll(&mut fds, wake.saturating_duration_since(now))
            .map_err(|e| cerr(format!("poll: {e}")))?;
        let ready: Vec<bool> = fds[1..].iter().map(|p| p.revents != 0).collect();
        for (q, s) in greetings.advance(&ready) {
            if peers[q].is_some() {
                tracing::warn!(rank, peer = q, "refused a second connection from one peer");
                continue;
            }
            tune(&s, timeout).map_err(|e| cerr(format!("socket options for rank {q}: {e}")))?;
            peers[q] = Some(s);
            missing -= 1;
        }
        if fds[0].revents != 0 {
            greetings.accept_all(&listener, deadline);
        }
    }
    Ok(peers)
}

/// Unknown connections entertained at once (at least twice the world size); a new one past
/// it drops the oldest.
const MAX_UNKNOWN: usize = 64;
/// Time for a peer's whole greeting, from its accept.
const GREETING: Duration = Duration::from_secs(5);
/// Greeting head: `ZRPR`, the dialer's rank, the token length.
const HEAD: usize = 12;

/// Greetings of accepted connections, read together so that a silent or slow connection
/// delays nobody: each must arrive whole within [`GREETING`].
struct Greetings<'a> {
    rank: usize,
    world: usize,
    token: &'a [u8],
    /// Oldest first.
    pending: Vec<Greeting>,
    cap: usize,
}

impl Greetings<'_> {
    /// Drops greetings past their deadline.
    fn expire(&mut self, now: Instant) {
        let rank = self.rank;
        self.pending.retain(|g| {
            let alive = g.deadline > now;
            if !alive {
                tracing::warn!(rank, from = %g.from, "dropped a peer connection: no whole greeting within {GREETING:?}");
            }
            alive
        });
    }

    /// Accepts what waits in the backlog (errors are left for the next round: the overall
    /// deadline bounds them).
    fn accept_all(&mut self, listener: &TcpListener, deadline: Instant) {
        for _ in 0..64 {
            let (s, from) = match listener.accept() {
                Ok(x) => x,
                Err(e) if greet::out_of_resources(&e) => {
                    // Free a descriptor and let the next poll round retry.
                    if !self.pending.is_empty() {
                        self.pending.remove(0);
                    }
                    std::thread::sleep(Duration::from_millis(10));
                    return;
                }
                Err(_) => return,
            };
            let until = (Instant::now() + GREETING).min(deadline);
            if let Ok(g) = Greeting::new(s, from, HELLO, HEAD, until) {
                if self.pending.len() >= self.cap {
                    let old = self.pending.remove(0);
                    tracing::warn!(rank = self.rank, from = %old.from, "dropped a peer connection: too many connections without a greeting");
                }
                self.pending.push(g);
            }
        }
    }

    /// Reads the greetings flagged `ready`; returns the peers that greeted well (rank, socket
    /// made blocking again).
    fn advance(&mut self, ready: &[bool]) -> Vec<(usize, TcpStream)> {
        let mut done = Vec::new();
        for finished in greet::advance(&mut self.pending, ready) {
            match finished {
                Ok(g) => {
                    let q = g.head_fields()[..4]
                        .try_into()
                        .map_or(usize::MAX, |b| u32::from_le_bytes(b) as usize);
                    let from = g.from;
                    let ok =
                        q > self.rank && q < self.world && greet::same_token(g.token(), self.token);
                    match g.into_stream() {
                        Ok(s) if ok => done.push((q, s)),
                        _ => {
                            tracing::warn!(rank = self.rank, %from, "refused a peer connection: bad rank or token")
                        }
                    }
                }
                Err(g) => {
                    tracing::warn!(rank = self.rank, from = %g.from, "refused a peer connection: bad greeting")
                }
            }
        }
        done
    }
}

/// The address peers should dial: the local side of the store connection's interface.
pub(crate) fn listen_on(ip: IpAddr, rank: usize) -> Result<TcpListener, Error> {
    TcpListener::bind((ip, 0)).map_err(|e| Error::Connect {
        rank,
        detail: format!("listening on {ip}: {e}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three ranks on loopback; before they start, rank 0's listener gets more silent
    /// connections than it entertains plus one that trickles a greeting. The real peers must
    /// still connect at once (each greeting is read on its own, with its own deadline).
    #[test]
    fn silent_connections_do_not_delay_the_real_peers() {
        let world = 3;
        let listeners: Vec<TcpListener> = (0..world)
            .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
            .collect();
        let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
        let silent: Vec<TcpStream> = (0..MAX_UNKNOWN + 10)
            .map(|_| TcpStream::connect(addrs[0]).unwrap())
            .collect();
        let mut trickle = TcpStream::connect(addrs[0]).unwrap();
        trickle.write_all(b"ZR").unwrap();
        let t = Instant::now();
        let (tx, rx) = std::sync::mpsc::channel();
        for (rank, l) in listeners.into_iter().enumerate() {
            let (addrs, tx) = (addrs.clone(), tx.clone());
            std::thread::spawn(move || {
                let got = connect_mesh(rank, l, &addrs, "tok", Duration::from_secs(30));
                let _ = tx.send((rank, got.map(|p| p.iter().filter(|s| s.is_some()).count())));
            });
        }
        for _ in 0..world {
            let (rank, got) = rx
                .recv_timeout(Duration::from_secs(3))
                .expect("a rank did not finish its mesh within 3 s");
            assert_eq!(got.unwrap(), world - 1, "rank {rank}");
        }
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "mesh took {:?}",
            t.elapsed()
        );
        drop((silent, trickle));
    }
}
