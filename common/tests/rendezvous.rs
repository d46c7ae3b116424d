//! `common::comm::rendezvous::exchange_root_bytes` over TCP on 127.0.0.1, one thread per rank.
use common::comm::rendezvous::exchange_root_bytes;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

const HOST: &str = "127.0.0.1";

/// A port that was free a moment ago (the OS picks it; the listener is dropped at once).
fn free_port() -> u16 {
    TcpListener::bind((HOST, 0)).unwrap().local_addr().unwrap().port()
}

fn id_bytes() -> Vec<u8> {
    (0..128u32).map(|i| (i * 7 + 3) as u8).collect()
}

fn spawn_peer(rank: usize, world_size: usize, port: u16, timeout: Duration) -> thread::JoinHandle<anyhow::Result<Vec<u8>>> {
    thread::spawn(move || exchange_root_bytes(rank, world_size, HOST, port, None, timeout))
}

#[test]
fn three_ranks_receive_the_roots_128_bytes() {
    let port = free_port();
    let timeout = Duration::from_secs(20);
    let root = thread::spawn(move || exchange_root_bytes(0, 3, HOST, port, Some(id_bytes()), timeout));
    let peers: Vec<_> = (1..3).map(|r| spawn_peer(r, 3, port, timeout)).collect();
    assert_eq!(root.join().unwrap().unwrap(), id_bytes());
    for peer in peers {
        assert_eq!(peer.join().unwrap().unwrap(), id_bytes());
    }
}

#[test]
fn root_starting_late_still_works() {
    let port = free_port();
    let timeout = Duration::from_secs(20);
    let peers: Vec<_> = (1..4).map(|r| spawn_peer(r, 4, port, timeout)).collect();
    // The peers are already retrying when the root comes up.
    thread::sleep(Duration::from_millis(500));
    let got = exchange_root_bytes(0, 4, HOST, port, Some(id_bytes()), timeout).unwrap();
    assert_eq!(got, id_bytes());
    for peer in peers {
        assert_eq!(peer.join().unwrap().unwrap(), id_bytes());
    }
}

#[test]
fn peer_with_another_world_size_is_rejected() {
    let port = free_port();
    let timeout = Duration::from_secs(20);
    let root = thread::spawn(move || exchange_root_bytes(0, 2, HOST, port, Some(id_bytes()), timeout));
    let peer = spawn_peer(1, 3, port, timeout);
    let peer_err = format!("{:#}", peer.join().unwrap().unwrap_err());
    let root_err = format!("{:#}", root.join().unwrap().unwrap_err());
    for err in [&peer_err, &root_err] {
        assert!(err.contains("world_size 3") && err.contains("world_size 2"), "{err}");
        assert!(err.contains(&format!("{HOST}:{port}")), "{err}");
    }
    assert!(peer_err.contains("refused by the root"), "{peer_err}");
}

#[test]
fn rejection_reaches_peers_that_already_joined() {
    let port = free_port();
    let timeout = Duration::from_secs(20);
    let root = thread::spawn(move || exchange_root_bytes(0, 3, HOST, port, Some(id_bytes()), timeout));
    let good = spawn_peer(1, 3, port, timeout);
    thread::sleep(Duration::from_millis(300));
    let bad = spawn_peer(2, 5, port, timeout);
    for handle in [good, bad] {
        let err = format!("{:#}", handle.join().unwrap().unwrap_err());
        assert!(err.contains("world_size 5") && err.contains("world_size 3"), "{err}");
    }
    assert!(root.join().unwrap().is_err());
}

#[test]
fn duplicate_rank_is_rejected() {
    let port = free_port();
    let timeout = Duration::from_secs(20);
    let root = thread::spawn(move || exchange_root_bytes(0, 3, HOST, port, Some(id_bytes()), timeout));
    let first = spawn_peer(1, 3, port, timeout);
    thread::sleep(Duration::from_millis(300));
    let second = spawn_peer(1, 3, port, timeout);
    let root_err = format!("{:#}", root.join().unwrap().unwrap_err());
    assert!(root_err.contains("rank 1 connected twice"), "{root_err}");
    for handle in [first, second] {
        let err = format!("{:#}", handle.join().unwrap().unwrap_err());
        assert!(err.contains("connected twice"), "{err}");
    }
}

#[test]
fn peer_times_out_when_the_root_never_appears() {
    let port = free_port();
    let start = Instant::now();
    let err = exchange_root_bytes(1, 2, HOST, port, None, Duration::from_secs(1)).unwrap_err();
    let elapsed = start.elapsed();
    let msg = format!("{err:#}");
    assert!(elapsed >= Duration::from_millis(900), "gave up after {elapsed:?}: {msg}");
    assert!(elapsed < Duration::from_secs(4), "took {elapsed:?}: {msg}");
    assert!(msg.contains(&format!("{HOST}:{port}")) && msg.contains("timed out") && msg.contains("1s"), "{msg}");
}

#[test]
fn root_times_out_naming_the_missing_ranks() {
    let port = free_port();
    let peer = spawn_peer(2, 3, port, Duration::from_secs(20));
    let start = Instant::now();
    let err = exchange_root_bytes(0, 3, HOST, port, Some(id_bytes()), Duration::from_secs(1)).unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(4));
    let msg = format!("{err:#}");
    assert!(msg.contains("timed out") && msg.contains(&format!("{HOST}:{port}")) && msg.contains("missing ranks [1]"), "{msg}");
    // The peer that did connect hears why instead of waiting for its own timeout.
    let peer_err = format!("{:#}", peer.join().unwrap().unwrap_err());
    assert!(peer_err.contains("missing ranks [1]"), "{peer_err}");
}

#[test]
fn connected_peer_times_out_when_others_never_come() {
    let port = free_port();
    let root = thread::spawn(move || exchange_root_bytes(0, 3, HOST, port, Some(id_bytes()), Duration::from_secs(3)));
    let start = Instant::now();
    let err = exchange_root_bytes(1, 3, HOST, port, None, Duration::from_secs(1)).unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(4));
    let msg = format!("{err:#}");
    assert!(msg.contains("timed out") && msg.contains(&format!("{HOST}:{port}")), "{msg}");
    assert!(root.join().unwrap().is_err());
}

#[test]
fn strangers_on_the_port_are_ignored() {
    let port = free_port();
    let timeout = Duration::from_secs(20);
    let root = thread::spawn(move || exchange_root_bytes(0, 2, HOST, port, Some(id_bytes()), timeout));
    // Something that is not a rendezvous peer connects first and speaks HTTP.
    let mut stranger = loop {
        match TcpStream::connect((HOST, port)) {
            Ok(s) => break s,
            Err(_) => thread::sleep(Duration::from_millis(20)),
        }
    };
    // Exactly as long as a hello (16 bytes), so the root reads it all before answering.
    stranger.write_all(b"GET / HTTP/1.0\r\n").unwrap();
    let mut answer = Vec::new();
    stranger.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = stranger.read_to_end(&mut answer);
    assert!(String::from_utf8_lossy(&answer).contains("not a rendezvous hello"));
    // The real peer still gets the bytes.
    assert_eq!(spawn_peer(1, 2, port, timeout).join().unwrap().unwrap(), id_bytes());
    assert_eq!(root.join().unwrap().unwrap(), id_bytes());
}

#[test]
fn peer_reaching_something_else_says_so() {
    // A server that is not a rendezvous root answers with garbage.
    let listener = TcpListener::bind((HOST, 0)).unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut hello = [0u8; 16];
        let _ = s.read_exact(&mut hello);
        s.write_all(b"SSH-2.0-OpenSSH_9.6 and then some more bytes\r\n").unwrap();
    });
    let msg = format!("{:#}", exchange_root_bytes(1, 2, HOST, port, None, Duration::from_secs(5)).unwrap_err());
    assert!(msg.contains("not a rendezvous root") && msg.contains(&format!("{HOST}:{port}")), "{msg}");
    server.join().unwrap();
}

#[test]
fn arguments_are_checked() {
    let err = exchange_root_bytes(3, 3, HOST, 29500, None, Duration::from_secs(1)).unwrap_err().to_string();
    assert!(err.contains("rank 3") && err.contains("size 3"), "{err}");
    let err = exchange_root_bytes(0, 2, HOST, 29500, None, Duration::from_secs(1)).unwrap_err().to_string();
    assert!(err.contains("rank 0"), "{err}");
    let err = exchange_root_bytes(1, 2, HOST, 0, None, Duration::from_secs(1)).unwrap_err().to_string();
    assert!(err.contains("MASTER_PORT"), "{err}");
    // A world of one opens nothing and returns the bytes (port 0 is fine then).
    assert_eq!(exchange_root_bytes(0, 1, HOST, 0, Some(vec![1, 2, 3]), Duration::ZERO).unwrap(), vec![1, 2, 3]);
}

#[test]
fn root_says_when_the_port_is_taken() {
    let taken = TcpListener::bind((HOST, 0)).unwrap();
    let port = taken.local_addr().unwrap().port();
    let msg = format!("{:#}", exchange_root_bytes(0, 2, HOST, port, Some(id_bytes()), Duration::from_secs(1)).unwrap_err());
    assert!(msg.contains("cannot listen") && msg.contains(&format!("{HOST}:{port}")), "{msg}");
    drop(taken);
}
