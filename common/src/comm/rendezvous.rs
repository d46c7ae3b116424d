//! Handing a few bytes from rank 0 to every other rank over TCP, the way PyTorch's `env://`
//! init method does: rank 0 listens on `MASTER_ADDR:MASTER_PORT`, every other rank connects
//! to it. Used to distribute NCCL's unique id (128 bytes) before `ncclCommInitRank`; CPU only,
//! no CUDA, no MPI.
//!
//! Protocol (all integers big-endian), one short-lived connection per peer:
//!
//! ```text
//! peer -> root   hello:  MAGIC (8 bytes) | rank u32 | world_size u32
//! root -> peer   reply:  MAGIC (8 bytes) | status u8 | length u64 | payload
//!                        status 0: payload = the root's bytes
//!                        status 1: payload = UTF-8 reason the root refused or gave up
//! ```
//!
//! The root answers only once all `world_size - 1` peers have said hello, so either every rank
//! gets the bytes or none does. A peer announcing another world size, a rank outside the
//! world, or a rank already taken makes the root give up (that job is misconfigured) and tell
//! every connected peer why; the error names both values. A connection that does not speak
//! this protocol (a port scanner, another program on the port) is refused and ignored. A peer
//! that reaches something other than a rendezvous root gets an error saying so.
//!
//! Timeouts: the root waits at most `timeout` for all peers; a peer retries connecting (the
//! root may start later) and then waits for the reply, in all at most `timeout`. Errors say
//! which address was used and for how long.
//!
//! Addresses: the root binds exactly `master_addr:master_port` (so `MASTER_ADDR` must be an
//! address of rank 0's node that the other nodes reach; a host name that resolves to a
//! loopback address on rank 0's node only works within one node); the peers connect to the
//! same. Nothing else is opened. Under torchrun, `MASTER_PORT` itself is taken: torchrun's
//! agent serves its own TCPStore there (`TORCHELASTIC_USE_AGENT_STORE=True`), so the caller
//! must pick another port (e.g. `MASTER_PORT + 1`) the same way on every rank.
use anyhow::{anyhow, bail, Context};
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// First bytes of every message, so that strangers on the port are recognised.
const MAGIC: [u8; 8] = *b"HPCRDV01";
const HELLO_LEN: usize = 16;
const STATUS_OK: u8 = 0;
const STATUS_REFUSED: u8 = 1;
/// Largest payload a peer accepts (the NCCL id is 128 bytes); guards against garbage lengths.
const MAX_PAYLOAD: u64 = 16 << 20;
/// How long the root waits for a connected client to say hello before dropping it.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// Pause between a peer's connection attempts while the root is not up yet.
const RETRY_PAUSE: Duration = Duration::from_millis(50);

/// Sends `bytes_on_root` (given on rank 0, ignored elsewhere) from rank 0 to every rank and
/// returns it on every rank, rank 0 included.
///
/// Rank 0 listens on `master_addr:master_port` and accepts `world_size - 1` connections;
/// the other ranks connect (retrying until `timeout`, since the root may start later) and
/// receive the bytes. With `world_size == 1` nothing is opened.
pub fn exchange_root_bytes(
    rank: usize,
    world_size: usize,
    master_addr: &str,
    master_port: u16,
    bytes_on_root: Option<Vec<u8>>,
    timeout: Duration,
) -> anyhow::Result<Vec<u8>> {
    if world_size == 0 {
        bail!("rendezvous: world_size must be at least 1");
    }
    if world_size > u32::MAX as usize {
        bail!("rendezvous: world_size {world_size} is too large");
    }
    if rank >= world_size {
        bail!("rendezvous: rank {rank} is outside the world of size {world_size} (ranks 0..{})", world_size - 1);
    }
    if rank == 0 {
        let bytes = bytes_on_root.ok_or_else(|| anyhow!("rendezvous: rank 0 (the root) must supply the bytes to send"))?;
        if bytes.len() as u64 > MAX_PAYLOAD {
            bail!("rendezvous: {} bytes to send, at most {MAX_PAYLOAD} supported", bytes.len());
        }
        if world_size == 1 {
            return Ok(bytes);
        }
        check_port(master_port)?;
        serve(world_size, master_addr, master_port, &bytes, timeout)?;
        Ok(bytes)
    } else {
        check_port(master_port)?;
        fetch(rank, world_size, master_addr, master_port, timeout)
    }
}

fn check_port(port: u16) -> anyhow::Result<()> {
    if port == 0 {
        bail!("rendezvous: MASTER_PORT is 0; every rank needs the same fixed port number (e.g. 29500)");
    }
    Ok(())
}

fn resolve(addr: &str, port: u16) -> std::io::Result<Vec<SocketAddr>> {
    let addrs: Vec<SocketAddr> = (addr, port).to_socket_addrs()?.collect();
    if addrs.is_empty() {
        return Err(std::io::Error::new(ErrorKind::NotFound, format!("{addr} resolves to no address")));
    }
    Ok(addrs)
}

/// `host:port`, with brackets for IPv6 literals.
fn display_addr(addr: &str, port: u16) -> String {
    if addr.contains(':') && !addr.starts_with('[') {
        format!("[{addr}]:{port}")
    } else {
        format!("{addr}:{port}")
    }
}

fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

// ---------------------------------------------------------------------------------------------
// Root (rank 0)

fn serve(world_size: usize, master_addr: &str, master_port: u16, bytes: &[u8], timeout: Duration) -> anyhow::Result<()> {
    let shown = display_addr(master_addr, master_port);
    let deadline = Instant::now() + timeout;
    let listener = listen(master_addr, master_port, &shown)?;
    let mut conns = accept_peers(&listener, world_size, &shown, deadline, timeout)?;
    drop(listener);

    for (peer_rank, slot) in conns.iter_mut().enumerate() {
        if let Some(stream) = slot.as_mut() {
            send_reply(stream, STATUS_OK, bytes).with_context(|| format!("rendezvous root at {shown}: sending the bytes to rank {peer_rank} failed"))?;
        }
    }
    Ok(())
}

/// A non-blocking listener on the first of `master_addr`'s addresses that binds; an error with
/// a hint at why none did.
fn listen(master_addr: &str, master_port: u16, shown: &str) -> anyhow::Result<TcpListener> {
    let addrs = resolve(master_addr, master_port).with_context(|| format!("rendezvous root: cannot resolve MASTER_ADDR {master_addr}"))?;
    let mut last_err = None;
    let mut listener = None;
    for addr in &addrs {
        match TcpListener::bind(addr) {
            Ok(l) => {
                listener = Some(l);
                break;
            }
            Err(e) => last_err = Some(e),
        }
    }
    let listener = match listener {
        Some(l) => l,
        None => {
            let in_use = last_err.as_ref().is_some_and(|e| e.kind() == ErrorKind::AddrInUse);
            let e = last_err.map(|e| e.to_string()).unwrap_or_default();
            let hint = if in_use && std::env::var("TORCHELASTIC_USE_AGENT_STORE").as_deref() == Ok("True") {
                "torchrun's agent already serves its TCPStore on MASTER_PORT: rendezvous on another port"
            } else if in_use {
                "another program, or an earlier run, uses that port"
            } else {
                "is MASTER_ADDR an address of this node?"
            };
            bail!("rendezvous root: cannot listen on {shown}: {e} ({hint})");
        }
    };
    listener.set_nonblocking(true).context("rendezvous root: cannot make the listener non-blocking")?;
    Ok(listener)
}

/// Accepts connections until every peer said a good hello, by `deadline`: slot r holds rank r's
/// connection (slot 0 unused). Strangers are refused and ignored; a peer of another job (or a
/// clash of ranks), the deadline, or a failed accept makes the root give up and tell every
/// connected peer why.
fn accept_peers(listener: &TcpListener, world_size: usize, shown: &str, deadline: Instant, timeout: Duration) -> anyhow::Result<Vec<Option<TcpStream>>> {
    let peers = world_size - 1;
    let mut conns: Vec<Option<TcpStream>> = (0..world_size).map(|_| None).collect();
    let mut joined = 0usize;
    let mut strangers = 0usize;
    while joined < peers {
        let (mut stream, from) = match listener.accept() {
            Ok(pair) => pair,
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                if Instant::now() >= deadline {
                    let missing: Vec<usize> = (1..world_size).filter(|&r| conns[r].is_none()).collect();
                    let reason = format!(
                        "rendezvous root: timed out after {timeout:?} listening on {shown}: {joined} of {peers} peers connected, missing ranks {missing:?}{}",
                        if strangers > 0 { format!(" ({strangers} connection(s) that were not rendezvous peers were refused)") } else { String::new() }
                    );
                    refuse_all(&mut conns, &reason);
                    bail!(reason);
                }
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            Err(e) => {
                let reason = format!("rendezvous root: accepting on {shown} failed: {e}");
                refuse_all(&mut conns, &reason);
                bail!(reason);
            }
        };
        let Some(hello) = read_hello(&mut stream, deadline) else {
            // Closed or silent: not a peer (a port probe); ignore it and keep waiting.
            strangers += 1;
            continue;
        };
        if hello[..8] != MAGIC {
            strangers += 1;
            let _ = send_reply(&mut stream, STATUS_REFUSED, b"not a rendezvous hello (wrong magic); this port is a rendezvous root");
            continue;
        }
        let peer_rank = u32::from_be_bytes(hello[8..12].try_into().unwrap()) as usize;
        let peer_world = u32::from_be_bytes(hello[12..16].try_into().unwrap()) as usize;
        if let Some(reason) = hello_problem(peer_rank, peer_world, world_size, &conns, shown, from) {
            let _ = send_reply(&mut stream, STATUS_REFUSED, reason.as_bytes());
            refuse_all(&mut conns, &reason);
            bail!(reason);
        }
        conns[peer_rank] = Some(stream);
        joined += 1;
    }
    Ok(conns)
}

/// The hello of an accepted connection, or None where it closed or stayed silent.
fn read_hello(stream: &mut TcpStream, deadline: Instant) -> Option<[u8; HELLO_LEN]> {
    // Accepted sockets must block (with timeouts) regardless of the listener's mode.
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_nodelay(true);
    let wait = remaining(deadline).clamp(Duration::from_millis(100), HELLO_TIMEOUT);
    let _ = stream.set_read_timeout(Some(wait));
    let _ = stream.set_write_timeout(Some(HELLO_TIMEOUT));
    let mut hello = [0u8; HELLO_LEN];
    stream.read_exact(&mut hello).ok().map(|()| hello)
}

/// Why a peer's hello shows a misconfigured job (another world size, rank 0 again, a rank
/// outside the world or one already taken), naming both values; None for a good one.
fn hello_problem(peer_rank: usize, peer_world: usize, world_size: usize, conns: &[Option<TcpStream>], shown: &str, from: SocketAddr) -> Option<String> {
    if peer_world != world_size {
        Some(format!(
            "rendezvous at {shown}: rank {peer_rank} (from {from}) has world_size {peer_world}, but the root (rank 0) has world_size {world_size}; all ranks must be launched with the same world size"
        ))
    } else if peer_rank == 0 {
        Some(format!("rendezvous at {shown}: a second process (from {from}) claims rank 0; only the root may be rank 0"))
    } else if peer_rank >= world_size {
        Some(format!("rendezvous at {shown}: rank {peer_rank} (from {from}) is outside the world of size {world_size}"))
    } else if conns[peer_rank].is_some() {
        Some(format!("rendezvous at {shown}: rank {peer_rank} connected twice (second time from {from}); two processes have the same rank"))
    } else {
        None
    }
}

fn send_reply(stream: &mut TcpStream, status: u8, payload: &[u8]) -> std::io::Result<()> {
    let mut msg = Vec::with_capacity(17 + payload.len());
    msg.extend_from_slice(&MAGIC);
    msg.push(status);
    msg.extend_from_slice(&(payload.len() as u64).to_be_bytes());
    msg.extend_from_slice(payload);
    stream.write_all(&msg)?;
    stream.flush()?;
    // Close our side so the peer sees the end of the message even if we exit right away.
    stream.shutdown(std::net::Shutdown::Write)
}

/// Tells every peer that already joined why the root gives up (best effort).
fn refuse_all(conns: &mut [Option<TcpStream>], reason: &str) {
    for stream in conns.iter_mut().flatten() {
        let _ = send_reply(stream, STATUS_REFUSED, reason.as_bytes());
    }
}

// ---------------------------------------------------------------------------------------------
// Peers (rank > 0)

fn fetch(rank: usize, world_size: usize, master_addr: &str, master_port: u16, timeout: Duration) -> anyhow::Result<Vec<u8>> {
    let shown = display_addr(master_addr, master_port);
    let start = Instant::now();
    let deadline = start + timeout;
    let mut stream = connect(rank, master_addr, master_port, &shown, timeout, deadline)?;
    let _ = stream.set_nodelay(true);

    let mut hello = [0u8; HELLO_LEN];
    hello[..8].copy_from_slice(&MAGIC);
    hello[8..12].copy_from_slice(&(rank as u32).to_be_bytes());
    hello[12..16].copy_from_slice(&(world_size as u32).to_be_bytes());
    let _ = stream.set_write_timeout(Some(remaining(deadline).max(Duration::from_millis(100))));
    stream.write_all(&hello).with_context(|| format!("rendezvous rank {rank}: sending hello to the root at {shown} failed"))?;

    let timed_out = |what: &str| {
        anyhow!(
            "rendezvous rank {rank}: timed out after {:?} (timeout {timeout:?}) waiting for {what} from the root at {shown}; connected, but the root has not heard from all {world_size} ranks yet (are all ranks launched, with the same MASTER_ADDR/MASTER_PORT? or is another program listening on that port?)",
            start.elapsed()
        )
    };
    let mut header = [0u8; 17];
    read_until(&mut stream, &mut header, deadline).map_err(|e| match e {
        ReadErr::TimedOut => timed_out("the reply"),
        ReadErr::Io(e) if e.kind() == ErrorKind::UnexpectedEof => {
            anyhow!("rendezvous rank {rank}: the root at {shown} closed the connection without replying (another program on that port, or rank 0 gave up?)")
        }
        ReadErr::Io(e) => anyhow!("rendezvous rank {rank}: reading the reply from the root at {shown} failed: {e}"),
    })?;
    if header[..8] != MAGIC {
        bail!("rendezvous rank {rank}: {shown} is not a rendezvous root (it answered with something else); check MASTER_PORT");
    }
    let status = header[8];
    let len = u64::from_be_bytes(header[9..17].try_into().unwrap());
    if len > MAX_PAYLOAD {
        bail!("rendezvous rank {rank}: the root at {shown} announced {len} bytes, more than the {MAX_PAYLOAD} accepted");
    }
    let mut payload = vec![0u8; len as usize];
    read_until(&mut stream, &mut payload, deadline).map_err(|e| match e {
        ReadErr::TimedOut => timed_out("the rest of the reply"),
        ReadErr::Io(e) => anyhow!("rendezvous rank {rank}: reading the reply from the root at {shown} failed: {e}"),
    })?;
    match status {
        STATUS_OK => Ok(payload),
        STATUS_REFUSED => bail!("rendezvous rank {rank} (world_size {world_size}): refused by the root at {shown}: {}", String::from_utf8_lossy(&payload)),
        other => bail!("rendezvous rank {rank}: the root at {shown} sent an unknown status {other}"),
    }
}

/// Connects to the root, retrying while it is not up yet, until `deadline`.
fn connect(rank: usize, master_addr: &str, master_port: u16, shown: &str, timeout: Duration, deadline: Instant) -> anyhow::Result<TcpStream> {
    let start = Instant::now();
    let mut attempts = 0usize;
    loop {
        attempts += 1;
        let last_err = match resolve(master_addr, master_port) {
            Ok(addrs) => {
                let mut last = None;
                for addr in addrs {
                    let budget = remaining(deadline).clamp(Duration::from_millis(10), Duration::from_secs(2));
                    match TcpStream::connect_timeout(&addr, budget) {
                        Ok(stream) => return Ok(stream),
                        Err(e) => last = Some(e),
                    }
                }
                last.map(|e| e.to_string()).unwrap_or_default()
            }
            Err(e) => format!("cannot resolve {master_addr}: {e}"),
        };
        if Instant::now() + RETRY_PAUSE >= deadline {
            bail!(
                "rendezvous rank {rank}: timed out after {:?} (timeout {timeout:?}, {attempts} attempts) connecting to the root (rank 0) at {shown}; last error: {last_err}; is rank 0 running, with the same MASTER_ADDR/MASTER_PORT?",
                start.elapsed()
            );
        }
        std::thread::sleep(RETRY_PAUSE);
    }
}

enum ReadErr {
    TimedOut,
    Io(std::io::Error),
}

/// `read_exact` that gives up at `deadline`.
fn read_until(stream: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> Result<(), ReadErr> {
    let mut filled = 0;
    while filled < buf.len() {
        let left = remaining(deadline);
        if left.is_zero() {
            return Err(ReadErr::TimedOut);
        }
        stream.set_read_timeout(Some(left)).map_err(ReadErr::Io)?;
        match stream.read(&mut buf[filled..]) {
            Ok(0) => return Err(ReadErr::Io(ErrorKind::UnexpectedEof.into())),
            Ok(n) => filled += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::TimedOut => return Err(ReadErr::TimedOut),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(ReadErr::Io(e)),
        }
    }
    Ok(())
}
