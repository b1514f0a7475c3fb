//! Socket connections between every pair of ranks, with I/O errors turned into errors that
//! name this rank, the op, the bytes and the peer.

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

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
    let deadline = Instant::now() + timeout;
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
    let mut missing = world - rank - 1;
    while missing > 0 {
        match listener.accept() {
            Ok((s, from)) => {
                s.set_nonblocking(false)
                    .map_err(|e| cerr(format!("accepted socket: {e}")))?;
                tune(&s, Duration::from_secs(10))
                    .map_err(|e| cerr(format!("socket options: {e}")))?;
                match read_hello(&s, token, world) {
                    Some(q) if q > rank && peers[q].is_none() => {
                        tune(&s, timeout).map_err(|e| cerr(format!("socket options: {e}")))?;
                        peers[q] = Some(s);
                        missing -= 1;
                    }
                    _ => {
                        tracing::warn!(rank, %from, "refused a peer connection: bad greeting or token")
                    }
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let absent: Vec<usize> =
                        (rank + 1..world).filter(|&q| peers[q].is_none()).collect();
                    return Err(cerr(format!(
                        "ranks {absent:?} did not connect within {timeout:?}"
                    )));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(cerr(format!("accept: {e}"))),
        }
    }
    Ok(peers)
}

fn read_hello(s: &TcpStream, token: &str, world: usize) -> Option<usize> {
    let mut r: &TcpStream = s;
    let mut head = [0u8; 12];
    r.read_exact(&mut head).ok()?;
    if &head[..4] != HELLO {
        return None;
    }
    let q = u32::from_le_bytes(head[4..8].try_into().ok()?) as usize;
    let n = u32::from_le_bytes(head[8..12].try_into().ok()?) as usize;
    if n > 4096 || q >= world {
        return None;
    }
    let mut t = vec![0u8; n];
    r.read_exact(&mut t).ok()?;
    let same = t.len() == token.len()
        && t.iter()
            .zip(token.as_bytes())
            .fold(0u8, |a, (x, y)| a | (x ^ y))
            == 0;
    same.then_some(q)
}

/// The address peers should dial: the local side of the store connection's interface.
pub(crate) fn listen_on(ip: IpAddr, rank: usize) -> Result<TcpListener, Error> {
    TcpListener::bind((ip, 0)).map_err(|e| Error::Connect {
        rank,
        detail: format!("listening on {ip}: {e}"),
    })
}
