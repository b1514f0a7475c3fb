//! A rank's first meeting, in one process over real sockets: a job whose ranks never come
//! (its message stays a line, on time, however large the world), and a port where another
//! service answers.

zrun_torch_ext::end_tests_without_destructors!();

use std::io::{Read, Write};
use std::net::TcpListener;
use std::time::{Duration, Instant};

use zrun_comm::{init, Backend, Error, StoreClient, StoreServer, Topology, TopologySource};

/// A port nobody listens on (bound, then freed).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

fn torchrun(rank: usize, world: usize, port: u16) -> Topology {
    Topology {
        rank,
        local_rank: 0,
        world_size: world,
        local_world_size: 1,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        source: TopologySource::Torchrun,
    }
}

#[test]
fn a_million_ranks_that_never_come_are_counted_in_a_line_on_time() {
    let timeout = Duration::from_secs(2);
    let t = Instant::now();
    let e = init(&torchrun(0, 1_000_000, free_port()), Backend::Tcp, timeout)
        .err()
        .expect("no other rank comes");
    let took = t.elapsed();
    let msg = e.to_string();
    assert!(
        msg.contains("rank 0: ranks 1-999999 (999999 of 1000000) did not join within 2 s"),
        "{msg}"
    );
    assert!(msg.len() < 600, "{} bytes: {}", msg.len(), &msg[..600]);
    // Once 28.9 MB and 11 s for a 5 s timeout: the keys were sent back and read one by one.
    assert!(took < timeout + Duration::from_secs(3), "took {took:?}");
}

#[test]
fn a_wait_for_many_keys_names_a_few_and_counts_the_rest() {
    let server = StoreServer::start("127.0.0.1:0", "t").unwrap();
    let addr = format!("127.0.0.1:{}", server.port());
    let c = StoreClient::connect(&addr, "t", Duration::from_secs(5)).unwrap();
    let keys: Vec<String> = (0..512).map(|r| format!("job/peer/{r}")).collect();
    for k in keys.iter().step_by(2).skip(1) {
        c.set(k, b"x").unwrap();
    }
    c.set(&keys[511], b"x").unwrap();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let e = c.wait(&refs, Duration::from_millis(300)).unwrap_err();
    let Error::StoreTimeout {
        missing,
        names,
        asked,
        ..
    } = &e
    else {
        panic!("not a timeout: {e}");
    };
    // Missing: 0, 1, then every odd index but 511.
    assert_eq!(missing[0], 0..2);
    assert_eq!(missing.len(), 255);
    assert_eq!(missing.iter().map(|r| r.len()).sum::<usize>(), 256);
    assert_eq!(
        names,
        &["job/peer/0", "job/peer/1", "job/peer/3", "job/peer/5"]
    );
    assert_eq!(*asked, 512);
    let msg = e.to_string();
    assert!(
        msg.contains("keys \"job/peer/0\", \"job/peer/1\", \"job/peer/3\", \"job/peer/5\", … (256 of 512) did not appear within 0.3 s"),
        "{msg}"
    );
    assert_eq!(
        zrun_comm::list_ranges(missing),
        "0-1, 3, 5, 7, 9, 11, 13, 15, and 247 more"
    );
}

/// Answers every connection on `listener` as a web server would, after reading a little.
fn serve_http(listener: TcpListener) {
    std::thread::spawn(move || {
        for s in listener.incoming() {
            let Ok(mut s) = s else { continue };
            let mut buf = [0u8; 64];
            let _ = s.set_read_timeout(Some(Duration::from_millis(100)));
            let _ = s.read(&mut buf);
            let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n");
        }
    });
}

#[test]
fn another_service_on_the_port_is_named_not_taken_for_a_wrong_token() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    serve_http(listener);
    let addr = format!("127.0.0.1:{port}");
    for token in ["", "some-token"] {
        let e = StoreClient::connect(&addr, token, Duration::from_secs(5)).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, Error::NotAStore { .. }), "{msg}");
        assert!(
            msg.contains(&format!("rendezvous store at {addr}: what answers there is not a zrun store (it sent \"HTTP/1.1 400"))
                && msg.contains("another service listens on that port")
                && msg.contains("MASTER_PORT"),
            "{msg}"
        );
        assert!(!msg.contains("token"), "{msg}");
        assert!(e.is_bad_input());
    }
    // A rank that is not rank 0 dials it through init: the same, at once.
    let t = Instant::now();
    let e = init(&torchrun(1, 2, port), Backend::Tcp, Duration::from_secs(30))
        .err()
        .expect("not a store");
    assert!(matches!(e, Error::NotAStore { .. }), "{e}");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
}

#[test]
fn a_real_store_with_another_token_is_still_a_wrong_token() {
    let server = StoreServer::start("127.0.0.1:0", "theirs").unwrap();
    let addr = format!("127.0.0.1:{}", server.port());
    let e = StoreClient::connect(&addr, "", Duration::from_secs(5)).unwrap_err();
    assert!(matches!(e, Error::StoreRefused { .. }), "{e}");
}
