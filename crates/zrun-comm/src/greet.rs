//! Reading the greetings of connections not yet authenticated, without a thread each: the
//! sockets are non-blocking, one thread polls them all, and each greeting must arrive whole
//! before its own deadline (a sender that trickles bytes gains nothing).
//!
//! A greeting is a fixed head whose last 4 bytes are a little-endian token length, then the
//! token (at most [`MAX_TOKEN`] bytes). The store's head is `ZRST` + length; the mesh's is
//! `ZRPR` + rank + length.

use std::io::{ErrorKind, Read};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// Longest token a greeting may carry.
pub(crate) const MAX_TOKEN: usize = 4096;

/// Constant-time comparison, so the token cannot be guessed byte by byte from timing.
pub(crate) fn same_token(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Where a greeting stands after [`Greeting::feed`].
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Progress {
    /// More bytes are needed.
    More,
    /// Head and token are complete.
    Done,
    /// The peer closed, the socket failed, the magic is wrong or the token is too long.
    Bad,
}

/// Feeds the greetings of `pending` that `ready` flags (by position); those still arriving
/// stay in `pending`. Returns the finished ones: `Ok` when complete (token not yet checked),
/// `Err` when bad.
pub(crate) fn advance(
    pending: &mut Vec<Greeting>,
    ready: &[bool],
) -> Vec<std::result::Result<Greeting, Greeting>> {
    let mut finished = Vec::new();
    let mut keep = Vec::with_capacity(pending.len());
    for (i, mut g) in std::mem::take(pending).into_iter().enumerate() {
        if !ready.get(i).copied().unwrap_or(false) {
            keep.push(g);
            continue;
        }
        match g.feed() {
            Progress::More => keep.push(g),
            Progress::Done => finished.push(Ok(g)),
            Progress::Bad => finished.push(Err(g)),
        }
    }
    *pending = keep;
    finished
}

/// One accepted connection whose greeting is still arriving.
#[derive(Debug)]
pub(crate) struct Greeting {
    pub(crate) stream: TcpStream,
    pub(crate) from: SocketAddr,
    pub(crate) deadline: Instant,
    magic: &'static [u8; 4],
    head: usize,
    buf: Vec<u8>,
}

impl Greeting {
    /// Makes `stream` non-blocking and starts reading a greeting that opens with `magic` and
    /// has a `head`-byte head (magic included, the token length last).
    pub(crate) fn new(
        stream: TcpStream,
        from: SocketAddr,
        magic: &'static [u8; 4],
        head: usize,
        deadline: Instant,
    ) -> std::io::Result<Greeting> {
        stream.set_nonblocking(true)?;
        Ok(Greeting {
            stream,
            from,
            deadline,
            magic,
            head,
            buf: Vec::with_capacity(head),
        })
    }

    fn want(&self) -> usize {
        if self.buf.len() < self.head {
            return self.head;
        }
        let n = self.buf[self.head - 4..self.head]
            .try_into()
            .map_or(0, u32::from_le_bytes) as usize;
        self.head + n
    }

    /// Reads what has arrived, never past the greeting (a request that follows it stays in
    /// the socket).
    pub(crate) fn feed(&mut self) -> Progress {
        loop {
            let want = self.want();
            if want > self.head + MAX_TOKEN {
                return Progress::Bad;
            }
            if self.buf.len() == want && self.buf.len() >= self.head {
                return Progress::Done;
            }
            let have = self.buf.len();
            self.buf.resize(want, 0);
            match self.stream.read(&mut self.buf[have..]) {
                Ok(0) => return Progress::Bad,
                Ok(n) => self.buf.truncate(have + n),
                Err(e) => {
                    self.buf.truncate(have);
                    match e.kind() {
                        ErrorKind::WouldBlock => return Progress::More,
                        ErrorKind::Interrupted => {}
                        _ => return Progress::Bad,
                    }
                }
            }
            let n = self.buf.len().min(4);
            if self.buf[..n] != self.magic[..n] {
                return Progress::Bad;
            }
        }
    }

    /// The head after the magic (valid once [`Progress::Done`]), token length included.
    pub(crate) fn head_fields(&self) -> &[u8] {
        &self.buf[4..self.head.min(self.buf.len())]
    }

    /// The token (valid once [`Progress::Done`]).
    pub(crate) fn token(&self) -> &[u8] {
        self.buf.get(self.head..).unwrap_or(&[])
    }

    /// The socket, made blocking again.
    pub(crate) fn into_stream(self) -> std::io::Result<TcpStream> {
        self.stream.set_nonblocking(false)?;
        Ok(self.stream)
    }
}

/// Waits up to `timeout` until one of `fds` is readable (or closed), retrying on EINTR.
/// Returns the number of ready descriptors; their `revents` are set.
pub(crate) fn poll(fds: &mut [libc::pollfd], timeout: Duration) -> std::io::Result<usize> {
    let ms = timeout.as_millis().clamp(0, i32::MAX as u128) as libc::c_int;
    // SAFETY: `fds` is a live, writable slice of `fds.len()` pollfd structs.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        return if e.kind() == ErrorKind::Interrupted {
            Ok(0)
        } else {
            Err(e)
        };
    }
    Ok(n as usize)
}

/// A `pollfd` asking whether `s` is readable.
pub(crate) fn readable(s: &impl AsRawFd) -> libc::pollfd {
    libc::pollfd {
        fd: s.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    }
}

/// True for accept errors that mean "out of descriptors or memory": retrying at once would
/// spin, since the pending connection keeps the listener readable.
pub(crate) fn out_of_resources(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::TcpListener;

    fn pair() -> (TcpStream, TcpStream, SocketAddr) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, from) = l.accept().unwrap();
        (c, s, from)
    }

    #[test]
    fn a_greeting_arrives_in_pieces_and_stops_at_its_end() {
        let (mut c, s, from) = pair();
        let far = Instant::now() + Duration::from_secs(5);
        let mut g = Greeting::new(s, from, b"ZRST", 8, far).unwrap();
        assert_eq!(g.feed(), Progress::More);
        c.write_all(b"ZR").unwrap();
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(g.feed(), Progress::More);
        c.write_all(b"ST\x03\x00\x00\x00abcEXTRA").unwrap();
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(g.feed(), Progress::Done);
        assert_eq!(g.token(), b"abc");
        let mut s = g.into_stream().unwrap();
        let mut rest = [0u8; 5];
        s.read_exact(&mut rest).unwrap();
        assert_eq!(&rest, b"EXTRA");
    }

    #[test]
    fn wrong_magic_long_tokens_and_closed_peers_are_bad() {
        let far = Instant::now() + Duration::from_secs(5);
        let (mut c, s, from) = pair();
        let mut g = Greeting::new(s, from, b"ZRST", 8, far).unwrap();
        c.write_all(b"GET / HTTP/1.1\r\n").unwrap();
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(g.feed(), Progress::Bad);
        let (mut c, s, from) = pair();
        let mut g = Greeting::new(s, from, b"ZRST", 8, far).unwrap();
        c.write_all(b"ZRST\xff\xff\xff\x7f").unwrap();
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(g.feed(), Progress::Bad);
        let (c, s, from) = pair();
        let mut g = Greeting::new(s, from, b"ZRST", 8, far).unwrap();
        drop(c);
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(g.feed(), Progress::Bad);
    }

    #[test]
    fn tokens_compare_in_full() {
        assert!(same_token(b"abc", b"abc"));
        assert!(!same_token(b"abc", b"abd"));
        assert!(!same_token(b"abc", b"abcd"));
    }
}
