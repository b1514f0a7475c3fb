//! The rendezvous store against untrusted connections, over real sockets: idle floods, bytes
//! that trickle in, a process out of descriptors, and nodes whose tokens differ.
//!
//! The flood and descriptor tests host the store in a child process (this binary re-executed
//! with `ZRUN_HOSTILE_ROLE`), so its descriptor limit, threads and CPU time are its own.

zrun_torch_ext::end_tests_without_destructors!();

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use zrun_comm::{Error, StoreClient, StoreLimits, StoreServer};

const ROLE: &str = "ZRUN_HOSTILE_ROLE";
const TOKEN: &str = "hostile-test-token";

fn role_is(name: &str) -> bool {
    std::env::var(ROLE).is_ok_and(|r| r == name)
}

/// Re-runs test `name` of this binary as a child with the role set; stdout piped.
fn spawn_child(name: &str, env: &[(&str, String)]) -> Child {
    let exe = std::env::current_exe().expect("test binary");
    let mut c = Command::new(exe);
    c.args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE, name)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    for (k, v) in env {
        c.env(k, v);
    }
    c.spawn().expect("spawn child")
}

/// The rest of the first line of `out` that holds `tag` (the harness may print the test's
/// name before it on the same line).
fn line_from(out: &mut BufReader<ChildStdout>, tag: &str) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        if out.read_line(&mut line).expect("child stdout") == 0 {
            panic!("child ended before printing {tag}");
        }
        if let Some(at) = line.find(tag) {
            return line[at + tag.len()..].trim().to_string();
        }
    }
}

/// The child's stdout, read line by line.
fn stdout_of(child: &mut Child) -> BufReader<ChildStdout> {
    BufReader::new(child.stdout.take().expect("piped stdout"))
}

fn set_nofile(soft: u64) -> u64 {
    // SAFETY: getrlimit/setrlimit on a live, writable rlimit struct.
    unsafe {
        let mut r = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut r);
        r.rlim_cur = soft.min(r.rlim_max);
        libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        r.rlim_cur
    }
}

fn count_dir(path: &str) -> usize {
    std::fs::read_dir(path).map_or(0, |d| d.count())
}

/// Whether the server has closed `s` (EOF or reset), polling up to `within`.
fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    s.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
    let end = Instant::now() + within;
    let mut b = [0u8; 16];
    while Instant::now() < end {
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return true,
        }
    }
    false
}

/// The child of [`idle_flood_does_not_keep_a_client_out`]: hosts a store under a descriptor
/// limit (1024, a cluster's usual) until its stdin closes.
fn host_store_until_stdin_closes() {
    let limit: u64 = std::env::var("HOSTILE_NOFILE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1024);
    set_nofile(limit);
    let server = StoreServer::start("127.0.0.1:0", TOKEN).expect("store");
    println!("PORT {}", server.port());
    std::io::stdout().flush().unwrap();
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
}

/// 2,000 idle connections (more than the store's 128 handshakes in flight, and more than the
/// child's 1,024 descriptors) to a store: a real client still joins and sets and gets within
/// 2 s, and the store's process keeps a bounded number of threads and descriptors.
#[test]
fn idle_flood_does_not_keep_a_client_out() {
    if role_is("idle_flood_does_not_keep_a_client_out") {
        return host_store_until_stdin_closes();
    }
    let mut child = spawn_child("idle_flood_does_not_keep_a_client_out", &[]);
    let mut out = stdout_of(&mut child);
    let port: u16 = line_from(&mut out, "PORT ").parse().unwrap();
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let have = set_nofile(1 << 16);
    let n = 2000.min(have.saturating_sub(200) as usize);
    assert!(
        n > 1100,
        "this test needs about 2,200 descriptors, the hard limit is {have}"
    );
    let t = Instant::now();
    let mut idle = Vec::with_capacity(n);
    // A store that stops accepting makes each further connect wait on a full backlog.
    while idle.len() < n && t.elapsed() < Duration::from_secs(3) {
        if let Ok(s) = TcpStream::connect_timeout(&addr, Duration::from_millis(100)) {
            idle.push(s);
        }
    }
    let opened = idle.len();
    let t = Instant::now();
    let joined =
        StoreClient::connect(&addr.to_string(), TOKEN, Duration::from_secs(2)).and_then(|c| {
            c.set("k", b"v")?;
            c.get("k")
        });
    let join = t.elapsed();
    let pid = child.id();
    let threads = count_dir(&format!("/proc/{pid}/task"));
    let fds = count_dir(&format!("/proc/{pid}/fd"));
    println!(
        "idle connections opened {opened}; store process: {threads} threads, {fds} descriptors; client joined in {join:?}"
    );
    drop(child.stdin.take());
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(joined.expect("client must join despite the flood"), b"v");
    assert!(join < Duration::from_secs(2), "joining took {join:?}");
    assert!(threads < 32, "store process has {threads} threads");
    assert!(fds < 300, "store process holds {fds} descriptors");
}

/// A handshake whose bytes trickle in (one every 100 ms, each well within any per-read
/// timeout) is closed by its whole-handshake deadline; a real client joins meanwhile.
#[test]
fn a_trickling_handshake_is_dropped_by_its_deadline() {
    let limits = StoreLimits {
        handshake: Duration::from_millis(500),
        ..StoreLimits::default()
    };
    let server = StoreServer::start_with("127.0.0.1:0", TOKEN, limits).unwrap();
    let addr = format!("127.0.0.1:{}", server.port());
    let mut slow = TcpStream::connect(&addr).unwrap();
    let t = Instant::now();
    let mut hello = b"ZRST".to_vec();
    hello.extend_from_slice(&4000u32.to_le_bytes());
    hello.extend(std::iter::repeat_n(b'x', 4000));
    let mut dropped = false;
    for b in hello.iter().take(40) {
        if slow.write_all(&[*b]).is_err() || closed_within(&mut slow, Duration::from_millis(100)) {
            dropped = true;
            break;
        }
    }
    let after = t.elapsed();
    assert!(
        dropped,
        "a handshake trickling for {after:?} was not dropped"
    );
    assert!(
        after < Duration::from_millis(1500),
        "dropped after {after:?}"
    );
    let c = StoreClient::connect(&addr, TOKEN, Duration::from_secs(2)).unwrap();
    c.set("a", b"1").unwrap();
}

/// An authenticated client whose request trickles in is dropped by the whole-request deadline,
/// while a `wait` that legitimately lasts longer than that deadline is still answered.
#[test]
fn a_trickling_request_is_dropped_but_a_long_wait_is_served() {
    let limits = StoreLimits {
        request: Duration::from_millis(500),
        ..StoreLimits::default()
    };
    let server = StoreServer::start_with("127.0.0.1:0", TOKEN, limits).unwrap();
    let addr = format!("127.0.0.1:{}", server.port());
    let waiter = {
        let addr = addr.clone();
        std::thread::spawn(move || {
            let c = StoreClient::connect(&addr, TOKEN, Duration::from_secs(5)).unwrap();
            let t = Instant::now();
            c.wait(&["late"], Duration::from_secs(5))
                .map(|()| t.elapsed())
        })
    };
    let mut slow = TcpStream::connect(&addr).unwrap();
    let mut hello = b"ZRST".to_vec();
    hello.extend_from_slice(&(TOKEN.len() as u32).to_le_bytes());
    hello.extend_from_slice(TOKEN.as_bytes());
    slow.write_all(&hello).unwrap();
    let mut ans = [9u8; 1];
    slow.read_exact(&mut ans).unwrap();
    assert_eq!(ans[0], 0, "the token is right");
    // A set whose key length arrives one byte per 150 ms.
    let t = Instant::now();
    let mut req = vec![1u8];
    req.extend_from_slice(&3u32.to_le_bytes());
    req.extend_from_slice(b"key");
    let mut dropped = false;
    for b in &req {
        if slow.write_all(&[*b]).is_err() || closed_within(&mut slow, Duration::from_millis(150)) {
            dropped = true;
            break;
        }
    }
    let after = t.elapsed();
    assert!(dropped, "a request trickling for {after:?} was not dropped");
    assert!(
        after < Duration::from_millis(1200),
        "dropped after {after:?}"
    );
    // The waiter has then waited more than twice the request deadline.
    std::thread::sleep(Duration::from_millis(1200).saturating_sub(after));
    let c = StoreClient::connect(&addr, TOKEN, Duration::from_secs(2)).unwrap();
    c.set("late", b"x").unwrap();
    let waited = waiter.join().unwrap().expect("the long wait is answered");
    assert!(
        waited > Duration::from_millis(1000),
        "waited only {waited:?}"
    );
}

/// CPU time (user + system) of this process.
fn cpu_time() -> Duration {
    // SAFETY: getrusage fills a live, writable rusage struct.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut ru);
        ru
    };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// The child of [`accept_out_of_descriptors_backs_off_and_recovers`].
fn emfile_child() {
    set_nofile(64);
    let server = StoreServer::start("127.0.0.1:0", TOKEN).expect("store");
    let addr: SocketAddr = ([127, 0, 0, 1], server.port()).into();
    // Take every descriptor left but one, then connect with that one: the connection waits in
    // the backlog and every accept fails with EMFILE.
    // SAFETY: opening /dev/null and duplicating it; all closed below.
    let null = unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY) };
    assert!(null >= 0);
    let mut filler = vec![null];
    loop {
        // SAFETY: duplicating a descriptor this function owns.
        let fd = unsafe { libc::dup(null) };
        if fd < 0 {
            break;
        }
        filler.push(fd);
    }
    // SAFETY: closing a descriptor this function opened.
    unsafe { libc::close(filler.pop().unwrap()) };
    let mut stuck = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).expect("connect");
    std::thread::sleep(Duration::from_millis(200));
    let (c0, t0) = (cpu_time(), Instant::now());
    std::thread::sleep(Duration::from_secs(1));
    let busy = (cpu_time() - c0).as_secs_f64() / t0.elapsed().as_secs_f64();
    println!("CPU {busy:.3}");
    for fd in filler {
        // SAFETY: closing descriptors this function opened.
        unsafe { libc::close(fd) };
    }
    let t = Instant::now();
    let mut hello = b"ZRST".to_vec();
    hello.extend_from_slice(&(TOKEN.len() as u32).to_le_bytes());
    hello.extend_from_slice(TOKEN.as_bytes());
    stuck
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let answered = stuck
        .write_all(&hello)
        .and_then(|()| {
            let mut a = [9u8; 1];
            stuck.read_exact(&mut a).map(|()| a[0])
        })
        .map_err(|e| e.to_string());
    println!("RECOVERED {answered:?} {:?}", t.elapsed());
    let c = StoreClient::connect(&addr.to_string(), TOKEN, Duration::from_secs(2)).expect("join");
    c.set("k", b"v").unwrap();
    println!("SERVED {}", c.get("k").unwrap() == b"v");
}

/// A store whose process runs out of descriptors while a connection waits does not spin in
/// accept (its CPU use over a second stays low), and serves that connection and new ones
/// once descriptors are free again.
#[test]
fn accept_out_of_descriptors_backs_off_and_recovers() {
    let name = "accept_out_of_descriptors_backs_off_and_recovers";
    if role_is(name) {
        return emfile_child();
    }
    let mut child = spawn_child(name, &[]);
    let mut out = stdout_of(&mut child);
    let busy: f64 = line_from(&mut out, "CPU ").parse().unwrap();
    let recovered = line_from(&mut out, "RECOVERED ");
    let served = line_from(&mut out, "SERVED ");
    let status = child.wait().unwrap();
    println!("out of descriptors: {busy:.3} CPU-s per s; recovered: {recovered}");
    assert!(status.success(), "child failed");
    assert!(
        busy < 0.25,
        "accept loop used {busy:.3} CPU-s per second out of descriptors"
    );
    assert!(recovered.starts_with("Ok(0)"), "{recovered}");
    assert_eq!(served, "true");
}

/// Nodes whose tokens differ (another secret file) are refused with an error that says how to
/// make them agree.
#[test]
fn a_wrong_token_is_told_how_to_share_one() {
    let server = StoreServer::start("127.0.0.1:0", &zrun_comm::job_token(b"node0", "r")).unwrap();
    let addr = format!("127.0.0.1:{}", server.port());
    let theirs = zrun_comm::job_token(b"node1", "r");
    let e = StoreClient::connect(&addr, &theirs, Duration::from_secs(2)).unwrap_err();
    assert!(matches!(e, Error::StoreRefused { .. }), "{e}");
    let msg = e.to_string();
    for needle in [
        "export the same ZRUN_JOB_TOKEN",
        "ZRUN_SECRET_FILE",
        "~/.config/zrun/secret",
    ] {
        assert!(msg.contains(needle), "{msg}");
    }
    assert!(!msg.contains('\n'));
}

/// Authenticated clients past `max_clients` are answered "full" (retried until the client's
/// deadline, then reported), and admitted once a place is free.
#[test]
fn clients_past_the_cap_are_told_the_store_is_full() {
    let limits = StoreLimits {
        max_clients: 2,
        ..StoreLimits::default()
    };
    let server = StoreServer::start_with("127.0.0.1:0", TOKEN, limits).unwrap();
    let addr = format!("127.0.0.1:{}", server.port());
    let short = Duration::from_millis(300);
    let a = StoreClient::connect(&addr, TOKEN, short).unwrap();
    let _b = StoreClient::connect(&addr, TOKEN, short).unwrap();
    let e = StoreClient::connect(&addr, TOKEN, short).unwrap_err();
    assert!(e.to_string().contains("maximum of clients"), "{e}");
    drop(a);
    let c = StoreClient::connect(&addr, TOKEN, Duration::from_secs(2)).unwrap();
    c.set("k", b"v").unwrap();
}
