//! `view`, `heatmap` and `serve` on tiny generated models: the files written, the limits named, the server's queue and its refusals.
// index loops over (layer, head, query) read like the maths; nested test types stay inline
#![allow(clippy::needless_range_loop, clippy::type_complexity)]

mod common;

use attnscope::model::tiny::tiny_model;
use attnscope::model::Arch;
use candle_core::quantized::GgmlDType;
use common::{
    attnscope, fails_with, run_json, run_ok, start_serve, stderr_of, succeeds, tiny_gguf,
};

fn http_get(addr: &str, target: &str) -> (String, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(60)))
        .unwrap();
    write!(s, "GET {target} HTTP/1.1\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    (
        head.lines().next().unwrap_or("").to_string(),
        body.to_string(),
    )
}

fn raw_request(addr: &str, request: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(60)))
        .unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out.lines().next().unwrap_or("").to_string()
}

/// The whole answer to a request (status line, headers and body), read to the end.
fn raw_answer(addr: &str, request: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(60)))
        .unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

/// The hardened server, without sleeps or timings: past its queue (here --max-concurrent 1 and
/// --queue 0, held by a client that has not finished its request) a request gets 503 with
/// Retry-After and the reason, and the place comes back once that client is answered; a client
/// that dribbles its request is cut off by the overall deadline (408) however often it sends;
/// a Host that is not this server (DNS rebinding) is refused; --bos reaches the page;
/// faithfulness is capped in tokens.
#[test]
fn serve_limits_slow_clients_hosts_and_load() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let (mut child, addr) = start_serve(&[
        "--model",
        m.to_str().unwrap(),
        "--addr",
        "127.0.0.1:0",
        "--max-concurrent",
        "1",
        "--queue",
        "0",
        "--request-timeout",
        "600",
        "--bos",
        "--max-faithfulness-tokens",
        "8",
    ]);
    let body = a_half_sent_request_holds_the_only_place(&addr);
    bos_reaches_the_page(&m, &body);
    only_local_hosts_are_answered(&addr);
    faithfulness_beyond_the_cap_is_refused(&addr);
    child.kill().unwrap();
    let _ = child.wait();
    a_dribbling_client_is_cut_off(&m);
}

/// A client that has sent half its request holds the only place, so the next request is refused
/// at once; once it is answered the place is free again. Returns the page then served.
fn a_half_sent_request_holds_the_only_place(addr: &str) -> String {
    use std::io::{Read, Write};
    // a client that has sent half its request holds the only place (the server accepts in
    // order, and this connection was made first) ...
    let mut holder = std::net::TcpStream::connect(addr).unwrap();
    holder
        .write_all(b"GET /view?text=the+hat HTTP/1.1\r\nHost: localhost\r\n")
        .unwrap();
    // ... so the next request is refused at once, with when to come back and why
    let busy = raw_answer(addr, &format!("GET / HTTP/1.1\r\nHost: {addr}\r\n\r\n"));
    assert!(busy.starts_with("HTTP/1.1 503"), "{busy}");
    assert!(busy.contains("\r\nRetry-After: "), "{busy}");
    assert!(
        busy.contains("its queue is full") && busy.contains("--queue 0"),
        "{busy}"
    );
    // the holder finishes its request and is answered; then the place is free again
    holder.write_all(b"\r\n").unwrap();
    let mut answer = String::new();
    holder.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let (status, body) = http_get(addr, "/view?text=the+hat");
    assert!(status.contains("200"), "the place came back: {status}");
    body
}

/// The page (`body`) served with `--bos` has one token more than `inspect` finds in the text.
fn bos_reaches_the_page(m: &std::path::Path, body: &str) {
    let plain = run_json([
        "inspect",
        "--model",
        m.to_str().unwrap(),
        "--text",
        "the hat",
        "--json",
    ]);
    let n: usize = plain["tokens"].as_array().unwrap().len();
    assert!(
        body.contains(&format!("· {} tokens", n + 1)),
        "--bos did not reach the page (text has {n} tokens)"
    );
}

/// A request for another host is refused (421), one without a Host is bad (400).
fn only_local_hosts_are_answered(addr: &str) {
    for host in ["evil.example", "evil.example:80", "localhost.evil.example"] {
        let status = raw_request(addr, &format!("GET / HTTP/1.1\r\nHost: {host}\r\n\r\n"));
        assert!(status.contains("421"), "{host}: {status}");
    }
    assert!(
        raw_request(addr, "GET / HTTP/1.1\r\n\r\n").contains("400"),
        "no Host"
    );
    assert!(raw_request(addr, "GET / HTTP/1.1\r\nHost: localhost\r\n\r\n").contains("200"));
}

/// Faithfulness beyond the cap is refused with the reason; below it, it runs.
fn faithfulness_beyond_the_cap_is_refused(addr: &str) {
    let (status, body) = http_get(
        addr,
        "/view?text=the+hat+at+the+hat+at+the+hat+at+the+hat&faithfulness=1",
    );
    assert!(
        status.contains("413") && body.contains("--max-faithfulness-tokens"),
        "{status}"
    );
    let (status, _) = http_get(addr, "/view?text=the&faithfulness=1");
    assert!(status.contains("200"), "{status}");
}

/// A client that dribbles a byte at a time: each byte comes well within any read timeout, but the
/// overall deadline (1 s) cuts it off with 408. The dribbling stops when the answer arrives (an
/// event); the cap on bytes (~100 s of dribbling) only turns a server that never cuts it off into
/// a failure instead of a hang.
fn a_dribbling_client_is_cut_off(m: &std::path::Path) {
    use std::io::{Read, Write};
    let (mut child, addr) = start_serve(&[
        "--model",
        m.to_str().unwrap(),
        "--addr",
        "127.0.0.1:0",
        "--request-timeout",
        "1",
    ]);
    let mut slow = std::net::TcpStream::connect(&addr).unwrap();
    let mut reader = slow.try_clone().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut out = String::new();
        let _ = reader.read_to_string(&mut out);
        let _ = tx.send(out);
    });
    slow.write_all(b"GET / HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
        .unwrap();
    let mut sent = 0;
    let answer = loop {
        match rx.recv_timeout(std::time::Duration::from_millis(50)) {
            Ok(a) => break a,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(e) => panic!("{e}"),
        }
        // the server may close first; the answer is then on its way to the reader
        let _ = slow.write_all(b"a");
        sent += 1;
        assert!(sent < 2000, "a dribbling client was never cut off");
    };
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("--request-timeout"), "{answer}");
    // its place came back
    let (status, _) = http_get(&addr, "/view?text=the+hat");
    assert!(status.contains("200"), "{status}");
    child.kill().unwrap();
    let _ = child.wait();
}

/// The server under load: 16 clients on loopback each send 8 requests, one after another, to a
/// server that computes 2 pages at a time. The outcome is counted, not timed: every request is
/// answered (none lost), each with its own page or with the one refusal the docs allow here (503
/// with Retry-After, "the server is busy": its wait would pass `--queue-timeout`; never "its
/// queue is full", since at most 16 requests are open against a queue of 2 + 64). The first
/// request finds both places free, so at least one page is served. The server's peak memory
/// stays bounded (Linux: VmHWM).
#[test]
fn serve_queues_concurrent_clients_and_answers_every_request() {
    const CLIENTS: usize = 16;
    const REQUESTS: usize = 8;
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let (mut child, addr) = start_serve(&[
        "--model",
        m.to_str().unwrap(),
        "--addr",
        "127.0.0.1:0",
        "--max-concurrent",
        "2",
    ]);
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let a = addr.clone();
            std::thread::spawn(move || {
                (0..REQUESTS)
                    .map(|r| {
                        let text = format!("the hat {c} at {r}");
                        let q = text.replace(' ', "+");
                        let req = format!("GET /view?text={q} HTTP/1.1\r\nHost: localhost\r\n\r\n");
                        (text, raw_answer(&a, &req))
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let answers: Vec<(String, String)> = clients
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    assert_eq!(answers.len(), CLIENTS * REQUESTS);
    let (mut ok, mut refused) = (0, 0);
    for (text, a) in &answers {
        if a.starts_with("HTTP/1.1 200") {
            assert_eq!(
                page_text(a),
                text.replace(' ', ""),
                "a page for another text"
            );
            ok += 1;
        } else {
            assert_is_a_busy_refusal(a);
            refused += 1;
        }
    }
    let peak_kb = std::fs::read_to_string(format!("/proc/{}/status", child.id()))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        });
    eprintln!(
        "serve load: {} requests from {CLIENTS} clients: {ok} pages, {refused} refused (waits past --queue-timeout); server peak memory {peak_kb:?} kB",
        answers.len()
    );
    assert_eq!(ok + refused, CLIENTS * REQUESTS);
    assert!(ok >= 1, "no page was served: {refused} refused");
    if let Some(kb) = peak_kb {
        assert!(kb < 1 << 20, "the server's peak memory is {kb} kB");
    }
    child.kill().unwrap();
    let _ = child.wait();
}

/// The text of the page in a whole answer (its tokens, from the page's data, joined without
/// spaces or the tokenizer's space marks).
fn page_text(answer: &str) -> String {
    let at = answer.find("const D = ").expect("a page without its data") + "const D = ".len();
    let d: serde_json::Value = serde_json::Deserializer::from_str(&answer[at..])
        .into_iter()
        .next()
        .expect("the page's data")
        .expect("the page's data is JSON");
    assert!(answer.contains("Head view"), "a 200 without its page");
    d["tokens"]
        .as_array()
        .expect("the page's tokens")
        .iter()
        .map(|t| t.as_str().expect("a token is a string"))
        .collect::<String>()
        .replace(['Ġ', '▁'], "")
        .split_whitespace()
        .collect()
}

/// A 503 the docs allow for a queue that never fills: Retry-After, and "the server is busy"
/// because the wait would pass (or did pass) `--queue-timeout`.
fn assert_is_a_busy_refusal(a: &str) {
    let first = a.lines().next();
    assert!(
        a.starts_with("HTTP/1.1 503")
            && a.contains("Retry-After: ")
            && a.contains("the server is busy"),
        "an answer that is neither a page nor a refusal with a reason: {first:?}"
    );
    assert!(
        a.contains("--queue-timeout") && !a.contains("its queue is full"),
        "a refusal the queue's size does not allow (16 open requests, 2 + 64 places): {first:?}"
    );
}

/// `serve` answers on loopback, survives 100 sequential requests and 8 concurrent ones, and
/// answers bad requests with a page that says what is wrong.
#[test]
fn serve_survives_sequential_and_concurrent_requests() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let (mut child, addr) = start_serve(&[
        "--model",
        m.to_str().unwrap(),
        "--addr",
        "127.0.0.1:0",
        "--max-concurrent",
        "16",
    ]);
    let (status, body) = http_get(&addr, "/");
    assert!(status.contains("200") && body.contains("<form"), "{status}");
    for i in 0..100 {
        let (status, body) = http_get(&addr, &format!("/view?text=the+hat+{i}"));
        assert!(status.contains("200"), "request {i}: {status}");
        assert!(body.contains("Head view") && body.contains("\"n_heads\":4"));
    }
    let handles: Vec<_> = (0..8)
        .map(|i| {
            let a = addr.clone();
            std::thread::spawn(move || http_get(&a, &format!("/view?text=at+the+{i}")))
        })
        .collect();
    for h in handles {
        let (status, body) = h.join().unwrap();
        assert!(
            status.contains("200") && body.contains("Head view"),
            "a concurrent request failed: {status}"
        );
    }
    let (status, body) = http_get(&addr, "/view?text=%20%20");
    assert!(
        status.contains("400") && body.contains("text is empty"),
        "{status}"
    );
    let (status, body) = http_get(&addr, &format!("/view?text={}", "a".repeat(3000)));
    assert!(
        status.contains("413") && body.contains("at most 2000"),
        "{status}"
    );
    let (status, _) = http_get(&addr, "/nothing");
    assert!(status.contains("404"));
    let (status, _) = http_get(&addr, "/");
    assert!(status.contains("200"), "still serving after all that");
    child.kill().unwrap();
    let _ = child.wait();
}

/// A TCP connection to `to` from the local address `from` (bound first: on Linux every
/// address of 127/8 is loopback, so 127.0.0.2 is another client address on this machine).
fn connect_from(from: std::net::Ipv4Addr, to: std::net::SocketAddrV4) -> std::net::TcpStream {
    use std::os::fd::FromRawFd;
    let sockaddr = |ip: std::net::Ipv4Addr, port: u16| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(ip).to_be(),
        },
        sin_zero: [0; 8],
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: a fresh socket, owned by the TcpStream from here on (closed when it drops)
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
    // SAFETY: fd is a valid socket no one else owns
    let stream = unsafe { std::net::TcpStream::from_raw_fd(fd) };
    let (local, remote) = (sockaddr(from, 0), sockaddr(*to.ip(), to.port()));
    // SAFETY: both addresses are sockaddr_in values that live across the calls, with their length
    let bound = unsafe { libc::bind(fd, (&raw const local).cast(), len) };
    assert_eq!(bound, 0, "bind {from}: {}", std::io::Error::last_os_error());
    // SAFETY: as above
    let connected = unsafe { libc::connect(fd, (&raw const remote).cast(), len) };
    assert_eq!(
        connected,
        0,
        "connect {to}: {}",
        std::io::Error::last_os_error()
    );
    stream
}

/// #56: ~70 idle connections from one client (connected, nothing sent) locked every other
/// client out, 10 s at a time: they held the whole queue (--max-concurrent 4 + --queue 64) until
/// the request timeout. Now one address holds at most --max-per-client (16) connections and its
/// others are answered 503 at once, so another client (127.0.0.2) is served while the idle ones
/// are still open. No timing: the server accepts in order, so every idle connection was
/// accepted before the other client's, and --request-timeout 600 keeps the held ones open.
#[test]
fn idle_connections_from_one_client_do_not_lock_out_another() {
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let (mut child, addr) = start_serve(&[
        "--model",
        m.to_str().unwrap(),
        "--addr",
        "127.0.0.1:0",
        "--request-timeout",
        "600",
    ]);
    let idle: Vec<std::net::TcpStream> = (0..70)
        .map(|_| std::net::TcpStream::connect(&addr).unwrap())
        .collect();
    let mut other = connect_from(std::net::Ipv4Addr::new(127, 0, 0, 2), addr.parse().unwrap());
    other
        .set_read_timeout(Some(std::time::Duration::from_secs(120)))
        .unwrap();
    write!(
        other,
        "GET /view?text=the+hat HTTP/1.1\r\nHost: {addr}\r\n\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    let _ = other.read_to_string(&mut answer);
    assert!(
        answer.starts_with("HTTP/1.1 200") && answer.contains("Head view"),
        "another client was not served while one held 70 idle connections: {:?}",
        answer.lines().next()
    );
    let (mut held, mut refused) = (0, 0);
    for mut s in idle {
        s.set_nonblocking(true).unwrap();
        let mut got = Vec::new();
        let r = s.read_to_end(&mut got);
        let got = String::from_utf8_lossy(&got);
        if got.is_empty() {
            assert!(
                matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
                "an idle connection was closed unanswered: {r:?}"
            );
            held += 1;
        } else {
            assert!(
                got.starts_with("HTTP/1.1 503")
                    && got.contains("Retry-After: ")
                    && got.contains("--max-per-client 16"),
                "{got}"
            );
            refused += 1;
        }
    }
    assert_eq!(
        (held, refused),
        (16, 54),
        "held and refused idle connections"
    );
    child.kill().unwrap();
    let _ = child.wait();
}

#[test]
fn view_and_heatmap_write_their_files() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let html = dir.path().join("v.html");
    run_ok([
        "view",
        "--model",
        m.to_str().unwrap(),
        "--text",
        "the hat",
        "--out",
        html.to_str().unwrap(),
        "--faithfulness",
    ]);
    let page = std::fs::read_to_string(&html).unwrap();
    assert!(
        page.contains("\"n_heads\":4")
            && page.contains("\"faithfulness\":{")
            && page.contains("Head view")
    );
    assert!(
        !page.contains("src=\"http") && !page.contains("<link"),
        "self-contained"
    );
    heatmaps_are_png_or_svg_and_bad_values_are_refused(&m, dir.path());
}

/// `heatmap` of one head as PNG, of the mean of the heads as SVG; another file type, or a head
/// out of range, is refused.
fn heatmaps_are_png_or_svg_and_bad_values_are_refused(m: &std::path::Path, dir: &std::path::Path) {
    let heatmap = |args: &[&str], out: &std::path::Path| {
        let mut c = attnscope();
        c.args(["heatmap", "--model", m.to_str().unwrap()])
            .args(args)
            .arg("--out")
            .arg(out);
        c
    };
    let png = dir.join("h.png");
    succeeds(&mut heatmap(
        &["--text", "the hat", "--layer", "1", "--head", "2"],
        &png,
    ));
    assert_eq!(&std::fs::read(&png).unwrap()[..4], b"\x89PNG");
    let svg = dir.join("h.svg");
    succeeds(&mut heatmap(&["--text", "the hat", "--layer", "0"], &svg));
    assert!(std::fs::read_to_string(&svg)
        .unwrap()
        .contains("mean of heads"));
    fails_with(
        &mut heatmap(&["--layer", "0"], std::path::Path::new("x.jpg")),
        2,
    );
    let bad = heatmap(&["--layer", "0", "--head", "9"], &dir.join("y.png"))
        .output()
        .unwrap();
    assert!(stderr_of(&bad).contains("head 9 is out of range"));
}

/// `view` above 4,096 tokens, or `--faithfulness` above 256, is refused with the limit named
/// (exit 2); the bounded page of 257..=4,096 tokens is written.
#[test]
fn view_limits_are_named() {
    use attnscope::model::tiny::write_gguf_with;
    use candle_core::quantized::gguf_file::Value;
    let dir = tempfile::tempdir().unwrap();
    let m = dir.path().join("tiny.gguf");
    write_gguf_with(
        &tiny_model(Arch::Qwen2, 1),
        Arch::Qwen2,
        GgmlDType::F32,
        &m,
        &|md, _| {
            for (k, v) in md.iter_mut() {
                if k.ends_with(".context_length") {
                    *v = Value::U32(8192);
                }
            }
        },
    )
    .unwrap();
    let out_path = dir.path().join("v.html");
    let view = |text: String, extra: &[&str]| {
        attnscope()
            .args([
                "view",
                "--model",
                m.to_str().unwrap(),
                "--force",
                "--out",
                out_path.to_str().unwrap(),
                "--text",
                &text,
            ])
            .args(extra)
            .output()
            .unwrap()
    };
    let out = view("the cat at the hat ".repeat(500), &[]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr_of(&out));
    assert!(
        stderr_of(&out).contains("at most 4096") && stderr_of(&out).contains("sinks"),
        "{}",
        stderr_of(&out)
    );
    let out = view("the cat at the hat ".repeat(40), &["--faithfulness"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr_of(&out));
    assert!(
        stderr_of(&out).contains("at most 256"),
        "{}",
        stderr_of(&out)
    );
    let out = view("the cat at the hat ".repeat(40), &[]);
    assert!(out.status.success(), "{}", stderr_of(&out));
    let page = std::fs::read_to_string(&out_path).unwrap();
    assert!(page.contains("\"encoding\":\"topk\"") && page.contains("\"k_head\":6"));
}
