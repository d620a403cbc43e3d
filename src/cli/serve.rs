//! `attnscope serve`: a local page to type a sentence and explore the views. The model is loaded
//! once; the server binds loopback by default and bounds the request size and the text. Pages
//! are computed `--max-concurrent` at a time; the requests that cannot start at once wait their
//! turn in a bounded queue (`--queue`), first come first served, up to a deadline
//! (`--queue-timeout`). A request is answered 503, with a `Retry-After` and the reason, only when
//! the queue is full or its wait would pass the deadline ([`Gate`]). One client address holds at
//! most `--max-per-client` connections at a time ([`Clients`]): past them its connections are
//! answered 503 at once, so idle connections from one client cannot fill the queue and lock the
//! others out (issue #56: ~70 half-open connections did, 10 s at a time).

use super::common::{emit, usage, ModelArgs};
use attnscope::render::html::html_escape;
use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Address to listen on (loopback by default; port 0 picks a free one).
    #[arg(long, default_value = "127.0.0.1:8377")]
    addr: String,
    /// Longest text accepted, in characters.
    #[arg(long, default_value_t = 2000)]
    max_chars: usize,
    /// Pages computed at once; the requests beyond wait their turn in the queue.
    #[arg(long, default_value_t = 4)]
    max_concurrent: usize,
    /// Requests that may wait for a turn besides those computed (or still being read); more
    /// are answered 503 with Retry-After at once.
    #[arg(long, default_value_t = 64)]
    queue: usize,
    /// Connections one client address may hold at once (being read, waiting or computed); its
    /// connections past them are answered 503 at once, so one client cannot fill the queue.
    #[arg(long, default_value_t = 16)]
    max_per_client: usize,
    /// Seconds a request may wait for its turn; one that would wait longer (judged from the
    /// recent pages' time) is answered 503 with Retry-After at once, not after the wait.
    #[arg(long, default_value_t = 30)]
    queue_timeout: u64,
    /// Seconds a client has to send its whole request, headers included (slow clients are cut
    /// off after it, and their place given back).
    #[arg(long, default_value_t = 5)]
    request_timeout: u64,
    /// Longest text (in tokens) on which the page's faithfulness panel is computed: occlusion
    /// runs one forward per token, which cannot be interrupted once started.
    #[arg(long, default_value_t = 128)]
    max_faithfulness_tokens: usize,
}

/// Seconds the whole answer may take to send (a view page is up to ~46 MB at 4,096 tokens).
const WRITE_DEADLINE_S: u64 = 120;

const MAX_REQUEST_LINE: usize = 16 * 1024;
const MAX_HEADERS: usize = 32 * 1024;

const FORM: &str = r#"<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>attnscope</title>
<style>body{font:15px system-ui,sans-serif;max-width:760px;margin:40px auto;color:#222}textarea{width:100%;height:90px;font-size:15px}
button{font-size:15px;padding:4px 14px}.err{background:#fdecea;border:1px solid #f5c2bd;padding:10px;border-radius:4px}</style></head>
<body><h1>attnscope</h1><p>MODEL</p><form method="get" action="/view"><textarea name="text" maxlength="MAXCHARS">Hà Nội là thủ đô của Việt Nam. Thành phố này nằm ở miền Bắc.</textarea>
EXTRA<button type="submit">Show attention</button></form>ERROR</body></html>"#;

/// The page's form: a decoder's asks whether to measure faithfulness too; an encoder's takes an
/// optional second text (a sentence pair, `[CLS] A [SEP] B [SEP]`) instead, since it predicts no
/// next token to measure.
const DECODER_EXTRA: &str = r#"<p><label><input type="checkbox" name="faithfulness" value="1"> also measure faithfulness (slower)</label></p>"#;
const ENCODER_EXTRA: &str = r#"<p>An encoder (bidirectional attention, no next-token prediction). Optionally a second text, for the sentence pair [CLS] A [SEP] B [SEP] (the head view then shows A→B, B→A, A→A, B→B):</p><textarea name="pair" maxlength="MAXCHARS" placeholder="second text (optional)"></textarea>"#;

fn form(model: &attnscope::model::Model, max_chars: usize, error: Option<&str>) -> String {
    let extra = if model.is_encoder() {
        ENCODER_EXTRA
    } else {
        DECODER_EXTRA
    };
    FORM.replace("EXTRA", extra)
        .replace("MODEL", &html_escape(&model.info.name))
        .replace("MAXCHARS", &max_chars.to_string())
        .replace(
            "ERROR",
            &error
                .map(|e| format!("<p class=\"err\">{}</p>", html_escape(e)))
                .unwrap_or_default(),
        )
}

/// Why a request was not served: answered 503 with `Retry-After` and this reason.
#[derive(Debug, PartialEq)]
pub enum Refusal {
    /// The queue is full: `open` requests are being read, waiting or computed.
    Full { open: usize, retry_s: u64 },
    /// Its wait, `ahead` requests before it of about `wait_s` seconds, would pass the deadline.
    TooLong {
        ahead: usize,
        wait_s: f64,
        retry_s: u64,
    },
    /// It waited until the deadline without getting a turn.
    Waited { retry_s: u64 },
}

impl Refusal {
    pub fn retry_after(&self) -> u64 {
        match self {
            Refusal::Full { retry_s, .. }
            | Refusal::TooLong { retry_s, .. }
            | Refusal::Waited { retry_s } => *retry_s,
        }
    }
    fn reason(&self, max_running: usize, max_waiting: usize, timeout_s: u64) -> String {
        match self {
            Refusal::Full { open, retry_s } => format!("the server is busy: its queue is full ({open} requests are being computed or waiting, --max-concurrent {max_running} + --queue {max_waiting}); try again in {retry_s} s"),
            Refusal::TooLong { ahead, wait_s, retry_s } => format!("the server is busy: {ahead} requests wait before this one, about {wait_s:.0} s, longer than it waits (--queue-timeout {timeout_s} s); try again in {retry_s} s"),
            Refusal::Waited { retry_s } => format!("the server is busy: this request waited {timeout_s} s (--queue-timeout) without its turn; try again in {retry_s} s"),
        }
    }
}

#[derive(Default)]
struct GateState {
    /// Requests admitted and not yet answered (being read, waiting or computed).
    open: usize,
    running: usize,
    /// The waiting requests' numbers, first come first.
    waiting: VecDeque<u64>,
    next: u64,
    /// Seconds a turn took, exponentially weighted (0 until one is measured).
    turn_s: f64,
}

/// Admission and turns: at most `max_running + max_waiting` requests are admitted at once
/// ([`Gate::admit`]: a [`Ticket`]); of those, `max_running` compute at a time and the others
/// wait in order for a turn ([`Ticket::turn`]) up to their deadline. Both are given back when
/// dropped, also when a handler panics.
pub struct Gate {
    state: Mutex<GateState>,
    turn_free: Condvar,
    max_running: usize,
    max_waiting: usize,
}

/// An admitted request (counted in the queue's size until dropped).
pub struct Ticket(Arc<Gate>);

/// A turn at the model, given back (to the next in the queue) when dropped.
pub struct Turn {
    gate: Arc<Gate>,
    started: Instant,
}

impl Gate {
    pub fn new(max_running: usize, max_waiting: usize) -> Arc<Gate> {
        Arc::new(Gate {
            state: Mutex::new(GateState::default()),
            turn_free: Condvar::new(),
            max_running: max_running.max(1),
            max_waiting,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        // the state stays consistent whatever a panicking handler was doing: its counts are
        // given back by the drops
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Seconds until `queued` requests (waiting or computed) are done, at the recent pace.
    fn seconds_for(&self, st: &GateState, queued: usize) -> f64 {
        st.turn_s * queued.div_ceil(self.max_running) as f64
    }

    fn retry_s(&self, st: &GateState, queued: usize) -> u64 {
        (self.seconds_for(st, queued).ceil() as u64).clamp(1, 3600)
    }

    /// A ticket if the queue has room (fewer than `max_running + max_waiting` admitted).
    pub fn admit(self: &Arc<Gate>) -> Result<Ticket, Refusal> {
        let mut st = self.lock();
        if st.open >= self.max_running + self.max_waiting {
            let retry_s = self.retry_s(&st, st.waiting.len() + 1);
            return Err(Refusal::Full {
                open: st.open,
                retry_s,
            });
        }
        st.open += 1;
        Ok(Ticket(self.clone()))
    }
}

impl Ticket {
    /// Waits for a turn, first come first served, until `deadline`; refused at once when the
    /// wait, judged from the recent turns' time, would pass it.
    pub fn turn(&self, deadline: Instant) -> Result<Turn, Refusal> {
        let gate = &self.0;
        let mut st = gate.lock();
        let me = st.next;
        st.next += 1;
        let ahead = st.waiting.len();
        let free = gate.max_running.saturating_sub(st.running);
        if ahead >= free {
            // it waits for the turns running and those ahead of it to end
            let wait_s = gate.seconds_for(&st, ahead + 1);
            let left = deadline
                .saturating_duration_since(Instant::now())
                .as_secs_f64();
            if wait_s > left {
                let retry_s = gate.retry_s(&st, ahead + 1);
                return Err(Refusal::TooLong {
                    ahead,
                    wait_s,
                    retry_s,
                });
            }
        }
        st.waiting.push_back(me);
        loop {
            let free = gate.max_running.saturating_sub(st.running);
            if st.waiting.iter().take(free).any(|&w| w == me) {
                st.waiting.retain(|&w| w != me);
                st.running += 1;
                return Ok(Turn {
                    gate: gate.clone(),
                    started: Instant::now(),
                });
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                st.waiting.retain(|&w| w != me);
                let retry_s = gate.retry_s(&st, st.waiting.len() + 1);
                // the one after it may be first now
                gate.turn_free.notify_all();
                return Err(Refusal::Waited { retry_s });
            }
            st = gate
                .turn_free
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.0.lock().open -= 1;
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        let took = self.started.elapsed().as_secs_f64();
        let mut st = self.gate.lock();
        st.running -= 1;
        st.turn_s = if st.turn_s == 0.0 {
            took
        } else {
            0.7 * st.turn_s + 0.3 * took
        };
        drop(st);
        self.gate.turn_free.notify_all();
    }
}

/// The connections each client address holds (being read, waiting or computed), at most
/// `max_each` per address ([`Clients::admit`]: a [`ClientSlot`], given back when dropped).
pub struct Clients {
    open: Mutex<std::collections::HashMap<std::net::IpAddr, usize>>,
    max_each: usize,
}

/// One connection of a client address, counted until dropped.
pub struct ClientSlot {
    clients: Arc<Clients>,
    ip: std::net::IpAddr,
}

impl Clients {
    pub fn new(max_each: usize) -> Arc<Clients> {
        Arc::new(Clients {
            open: Mutex::new(std::collections::HashMap::new()),
            max_each,
        })
    }

    fn lock(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<std::net::IpAddr, usize>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A slot for one more connection of `ip`, or `None` when it holds `max_each` already.
    pub fn admit(self: &Arc<Clients>, ip: std::net::IpAddr) -> Option<ClientSlot> {
        let mut open = self.lock();
        let n = open.entry(ip).or_insert(0);
        if *n >= self.max_each {
            return None;
        }
        *n += 1;
        Some(ClientSlot {
            clients: self.clone(),
            ip,
        })
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut open = self.clients.lock();
        if let Some(n) = open.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.ip);
            }
        }
    }
}

/// Reads or writes a stream within one overall deadline: each call waits at most the time
/// left, so a client that dribbles a byte at a time cannot hold a slot past the deadline.
struct Deadline<'a> {
    stream: &'a TcpStream,
    until: Instant,
}

impl Deadline<'_> {
    fn left(&self) -> std::io::Result<Duration> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the client took too long",
            ));
        }
        Ok(left)
    }
}

impl Read for Deadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.stream.set_read_timeout(Some(self.left()?))?;
        (&*self.stream).read(buf)
    }
}

impl Write for Deadline<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.stream.set_write_timeout(Some(self.left()?))?;
        // at most 1 MB per call, so the deadline is looked at while a big page goes out
        (&*self.stream).write(&buf[..buf.len().min(1 << 20)])
    }
    fn flush(&mut self) -> std::io::Result<()> {
        (&*self.stream).flush()
    }
}

/// Whether a `Host` header names this server: `localhost`, a loopback address, the address it
/// is bound to, or (bound to all interfaces) any IP literal. Anything else (a DNS name pointing
/// at 127.0.0.1 from a web page: DNS rebinding) is refused.
pub fn host_allowed(host: &str, bound: std::net::SocketAddr) -> bool {
    let host = host.trim();
    let name = if let Some(rest) = host.strip_prefix('[') {
        match rest.split_once(']') {
            Some((ip, _)) => ip,
            None => return false,
        }
    } else {
        host.rsplit_once(':').map_or(host, |(h, _)| h)
    };
    if name.eq_ignore_ascii_case("localhost") {
        return true;
    }
    match name.parse::<std::net::IpAddr>() {
        Ok(ip) => ip.is_loopback() || ip == bound.ip() || bound.ip().is_unspecified(),
        Err(_) => false,
    }
}

fn respond(stream: &mut TcpStream, status: &str, body: &str) {
    respond_with(stream, status, "", body)
}

/// The answer, with `extra` header lines (each ending in `\r\n`).
fn respond_with(stream: &mut TcpStream, status: &str, extra: &str, body: &str) {
    let head = format!("HTTP/1.1 {status}\r\nContent-Type: text/html; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\nX-Content-Type-Options: nosniff\r\n{extra}\r\n", body.len());
    let mut out = Deadline {
        stream,
        until: Instant::now() + Duration::from_secs(WRITE_DEADLINE_S),
    };
    let _ = out
        .write_all(head.as_bytes())
        .and_then(|_| out.write_all(body.as_bytes()));
}

/// Whether an error is a read that ran out of time.
fn timed_out(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
    )
}

/// The request line and the `Host` header, read (and bounded) within `until`; or the status
/// and reason to answer instead. The body, if any, is ignored: every request is a GET.
fn read_request(
    stream: &TcpStream,
    until: Instant,
) -> Result<(String, Option<String>), (&'static str, &'static str)> {
    const LATE: (&str, &str) = (
        "408 Request Timeout",
        "the request was not sent in time (--request-timeout)",
    );
    let mut reader = BufReader::new(Deadline { stream, until });
    let mut line = String::new();
    match reader
        .by_ref()
        .take(MAX_REQUEST_LINE as u64)
        .read_line(&mut line)
    {
        Ok(_) if line.ends_with('\n') => {}
        Err(e) if timed_out(&e) => return Err(LATE),
        _ => {
            return Err((
                "400 Bad Request",
                "the request line is too long or incomplete",
            ))
        }
    }
    let mut total = 0;
    let mut host = None;
    loop {
        let mut h = String::new();
        match reader.by_ref().take(MAX_HEADERS as u64).read_line(&mut h) {
            Ok(0) => break,
            Ok(k) => {
                total += k;
                if h == "\r\n" || h == "\n" {
                    break;
                }
                if let Some((name, value)) = h.split_once(':') {
                    if name.trim().eq_ignore_ascii_case("host") {
                        host = Some(value.trim().to_string());
                    }
                }
                if total > MAX_HEADERS {
                    return Err((
                        "431 Request Header Fields Too Large",
                        "the request headers are too large",
                    ));
                }
            }
            Err(e) if timed_out(&e) => return Err(LATE),
            Err(_) => return Err(("400 Bad Request", "the request could not be read")),
        }
    }
    Ok((line, host))
}

/// Answers one connection: the request read within `--request-timeout`, its Host checked
/// against `bound`, then the form, the view page (its turn at the model from `ticket`) or an
/// error page.
fn handle(
    stream: &mut TcpStream,
    model: &attnscope::model::Model,
    a: &Args,
    bound: std::net::SocketAddr,
    ticket: &Ticket,
) {
    let until = Instant::now() + Duration::from_secs(a.request_timeout);
    let (line, host) = match read_request(stream, until) {
        Ok(r) => r,
        Err((status, why)) => return respond(stream, status, &form(model, a.max_chars, Some(why))),
    };
    if let Err((status, why)) = check_host(host.as_deref(), bound) {
        return respond(stream, status, &form(model, a.max_chars, Some(&why)));
    }
    let mut parts = line.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    if method != "GET" {
        return respond(
            stream,
            "405 Method Not Allowed",
            &form(model, a.max_chars, Some("only GET is supported")),
        );
    }
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    match path {
        "/" => respond(stream, "200 OK", &form(model, a.max_chars, None)),
        // browsers ask for it on their own; an empty answer keeps their consoles clean
        "/favicon.ico" => respond(stream, "204 No Content", ""),
        "/view" => serve_view(stream, model, a, query, ticket),
        _ => respond(
            stream,
            "404 Not Found",
            &form(
                model,
                a.max_chars,
                Some(&format!("there is no page {path}")),
            ),
        ),
    }
}

/// Refuses a request without a Host header (400) or to a host that is not this server (421:
/// DNS rebinding).
fn check_host(
    host: Option<&str>,
    bound: std::net::SocketAddr,
) -> Result<(), (&'static str, String)> {
    match host {
        Some(h) if host_allowed(h, bound) => Ok(()),
        Some(h) => Err((
            "421 Misdirected Request",
            format!("this server answers to localhost, not to `{h}`"),
        )),
        None => Err(("400 Bad Request", "the request has no Host header".into())),
    }
}

/// What `/view?...` asks for: the text, an encoder's second text, the faithfulness panel.
struct ViewRequest {
    text: Option<String>,
    pair: Option<String>,
    faith: bool,
}

impl ViewRequest {
    /// The request in `query` (URL-encoded); an empty `pair` is none (the form sends one).
    fn parse(query: &str) -> ViewRequest {
        let mut r = ViewRequest {
            text: None,
            pair: None,
            faith: false,
        };
        for (k, v) in form_urlencoded::parse(query.as_bytes()) {
            match k.as_ref() {
                "text" => r.text = Some(v.into_owned()),
                // an encoder's second text; the form sends an empty one when left blank
                "pair" if !v.trim().is_empty() => r.pair = Some(v.into_owned()),
                "faithfulness" => r.faith = v == "1",
                _ => {}
            }
        }
        r
    }

    /// Refuses what this server will not run: no text (400), more than `--max-chars`
    /// characters, faithfulness on more than `--max-faithfulness-tokens` tokens (413).
    fn check(
        &self,
        model: &attnscope::model::Model,
        a: &Args,
    ) -> Result<(), (&'static str, String)> {
        let Some(text) = &self.text else {
            return Err(("400 Bad Request", "no text was given".into()));
        };
        let chars = text.chars().count() + self.pair.as_ref().map_or(0, |p| p.chars().count());
        if chars > a.max_chars {
            return Err((
                "413 Payload Too Large",
                format!(
                    "the text has {chars} characters; this server takes at most {}",
                    a.max_chars
                ),
            ));
        }
        if self.faith {
            match model.encode(text, a.model.bos) {
                Ok(t) if t.len() > a.max_faithfulness_tokens => {
                    let msg = format!("the text is {} tokens; this server measures faithfulness (one forward per token) on at most {} (--max-faithfulness-tokens); untick it, or run `attnscope faithfulness`", t.len(), a.max_faithfulness_tokens);
                    return Err(("413 Payload Too Large", msg));
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// `/view`: the request checked, a turn at the model waited for (or refused with 503), the page
/// made, the turn given back, then the page sent.
fn serve_view(
    stream: &mut TcpStream,
    model: &attnscope::model::Model,
    a: &Args,
    query: &str,
    ticket: &Ticket,
) {
    let req = ViewRequest::parse(query);
    if let Err((status, why)) = req.check(model, a) {
        return respond(stream, status, &form(model, a.max_chars, Some(&why)));
    }
    let text = req.text.as_deref().expect("checked");
    // the page waits its turn at the model; the answer is sent after the turn is given
    // back, so a client that reads slowly does not hold it
    let deadline = Instant::now() + Duration::from_secs(a.queue_timeout);
    let turn = match ticket.turn(deadline) {
        Ok(t) => t,
        Err(r) => return refuse(stream, model, a, &r),
    };
    let page = match &req.pair {
        None => attnscope::commands::view::view_html(model, text, a.model.bos, req.faith),
        Some(b) => view_pair(model, text, b, req.faith),
    };
    drop(turn);
    match page {
        Ok((html, _)) => respond(stream, "200 OK", &html),
        Err(e) => respond(
            stream,
            "400 Bad Request",
            &form(model, a.max_chars, Some(&format!("{e:#}"))),
        ),
    }
}

/// The view page of an encoder's sentence pair (a decoder's refusal says why).
fn view_pair(
    model: &attnscope::model::Model,
    a: &str,
    b: &str,
    faithfulness: bool,
) -> anyhow::Result<(String, usize)> {
    let (tokens, types, segments) = model.encode_pair_segments(a, b)?;
    let opts = attnscope::commands::view::ViewOptions {
        faithfulness,
        token_types: Some(types),
        segments: Some(segments),
        ..Default::default()
    };
    attnscope::commands::view::view_html_tokens(model, &tokens, &opts)
}

/// Answers 503 with `Retry-After` and the reason.
fn refuse(stream: &mut TcpStream, model: &attnscope::model::Model, a: &Args, r: &Refusal) {
    respond_with(
        stream,
        "503 Service Unavailable",
        &format!("Retry-After: {}\r\n", r.retry_after()),
        &form(
            model,
            a.max_chars,
            Some(&r.reason(a.max_concurrent, a.queue, a.queue_timeout)),
        ),
    )
}

/// Connections refused at once are answered on threads of their own (so a client that does
/// not read cannot stall the accept loop), at most this many at a time; past them a connection
/// is closed unanswered.
const MAX_REFUSING: usize = 64;

/// Seconds a refused client has to send its request before the 503 goes out anyway (the
/// request is read first: closing a socket with unread bytes would reset it, and the client
/// could lose the answer).
const REFUSE_READ_S: u64 = 2;

/// Closes a connection from a client address that holds `--max-per-client` connections already,
/// with a 503 saying so written without waiting (the socket's send buffer is empty; its request
/// is not read, so the accept loop never waits on that client).
fn refuse_client(mut stream: TcpStream, ip: std::net::IpAddr, max: usize) {
    let body = format!("<!DOCTYPE html><p>the server is busy for {ip}: it holds {max} connections from this address already (--max-per-client {max}); try again in 1 s</p>");
    let answer = format!("HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/html; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\nRetry-After: 1\r\n\r\n{body}", body.len());
    if stream.set_nonblocking(true).is_ok() {
        let _ = stream.write(answer.as_bytes());
    }
    let _ = stream.shutdown(std::net::Shutdown::Write);
}

pub fn run(a: Args) -> anyhow::Result<()> {
    if a.max_concurrent == 0
        || a.max_chars == 0
        || a.request_timeout == 0
        || a.queue_timeout == 0
        || a.max_per_client == 0
    {
        return Err(usage(
            "--max-concurrent, --max-chars, --request-timeout, --queue-timeout and --max-per-client must be at least 1",
        ));
    }
    let listener = TcpListener::bind(&a.addr)
        .map_err(|e| usage(format!("cannot listen on {}: {e}", a.addr)))?;
    let local = listener.local_addr()?;
    let model = a.model.load()?;
    if !local.ip().is_loopback() {
        eprintln!("attnscope: warning: listening on {local}, which other machines may reach");
    }
    emit(&format!(
        "attnscope serving {} on http://{local}/ (Ctrl-C to stop)\n",
        model.info.name
    ))?;
    let gate = Gate::new(a.max_concurrent, a.queue);
    let clients = Clients::new(a.max_per_client);
    let refusing = Arc::new(AtomicUsize::new(0));
    let a = Arc::new(a);
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else { continue };
        let Ok(peer) = stream.peer_addr() else {
            continue;
        };
        let Some(slot) = clients.admit(peer.ip()) else {
            refuse_client(stream, peer.ip(), a.max_per_client);
            continue;
        };
        let ticket = match gate.admit() {
            Ok(t) => t,
            Err(r) => {
                let taken = refusing.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                    (n < MAX_REFUSING).then_some(n + 1)
                });
                if taken.is_ok() {
                    let (m, a, refusing) = (model.clone(), a.clone(), refusing.clone());
                    std::thread::spawn(move || {
                        let until = Instant::now() + Duration::from_secs(REFUSE_READ_S);
                        let _ = read_request(&stream, until);
                        refuse(&mut stream, &m, &a, &r);
                        refusing.fetch_sub(1, Ordering::SeqCst);
                        drop(slot);
                    });
                }
                continue;
            }
        };
        let (model, a) = (model.clone(), a.clone());
        std::thread::spawn(move || {
            handle(&mut stream, &model, &a, local, &ticket);
            // the ticket and the client's slot are given back before the connection closes: a
            // client that has read its whole answer finds the place free (on a panic, when the
            // thread unwinds)
            drop(ticket);
            drop(slot);
            drop(stream);
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tickets_and_turns_are_given_back_even_when_a_handler_panics() {
        let gate = Gate::new(1, 1);
        let a = gate.admit().unwrap();
        let b = gate.admit().unwrap();
        assert!(
            matches!(gate.admit(), Err(Refusal::Full { open: 2, .. })),
            "a third request in a queue of 1 + 1"
        );
        let far = Instant::now() + Duration::from_secs(3600);
        let t = std::thread::spawn(move || {
            let _turn = b.turn(far).unwrap();
            panic!("a handler panics");
        });
        assert!(t.join().is_err());
        assert_eq!(gate.lock().open, 1);
        assert_eq!(gate.lock().running, 0);
        let c = gate.admit().unwrap();
        let turn = a.turn(far).unwrap();
        drop((turn, a, c));
        let st = gate.lock();
        assert_eq!((st.open, st.running, st.waiting.len()), (0, 0, 0));
    }

    /// Waiters get their turns in order as turns are given back; one whose wait would pass its
    /// deadline is refused at once (judged from the turns' measured time), and one that reaches
    /// its deadline waiting is refused then, and leaves the queue.
    #[test]
    fn waiters_are_served_in_order_and_refused_only_past_the_deadline() {
        use std::sync::mpsc;
        let gate = Gate::new(1, 8);
        let far = Instant::now() + Duration::from_secs(3600);
        let first = gate.admit().unwrap();
        let running = first.turn(far).unwrap();
        let (tx, rx) = mpsc::channel();
        let waiters: Vec<_> = (0..3)
            .map(|i| {
                let t = gate.admit().unwrap();
                let tx = tx.clone();
                let g = gate.clone();
                let w = std::thread::spawn(move || {
                    let turn = t.turn(far).unwrap();
                    tx.send(i).unwrap();
                    drop(turn);
                });
                // the next waiter joins only after this one is in the queue
                while g.lock().waiting.len() < i + 1 {
                    std::thread::yield_now();
                }
                w
            })
            .collect();
        // no measured turn yet: an estimate of 0 s, so a deadline already passed waits, and
        // is refused when it finds no turn
        let late = gate.admit().unwrap();
        assert!(matches!(
            late.turn(Instant::now()),
            Err(Refusal::Waited { .. })
        ));
        assert_eq!(
            gate.lock().waiting.len(),
            3,
            "the refused one left the queue"
        );
        drop(running);
        assert_eq!(rx.iter().take(3).collect::<Vec<_>>(), vec![0, 1, 2]);
        for w in waiters {
            w.join().unwrap();
        }
        // with a measured turn time, a wait past the deadline is refused before waiting
        let hold = first.turn(far).unwrap();
        gate.lock().turn_s = 10.0;
        let Err(r) = late.turn(Instant::now() + Duration::from_secs(5)) else {
            panic!("a wait of 10 s within 5 s was not refused")
        };
        assert_eq!(
            r,
            Refusal::TooLong {
                ahead: 0,
                wait_s: 10.0,
                retry_s: 10
            }
        );
        assert!(r.reason(1, 8, 5).contains("--queue-timeout 5 s"));
        drop(hold);
        assert!(late.turn(Instant::now() + Duration::from_secs(5)).is_ok());
    }

    #[test]
    fn hosts() {
        let lo: std::net::SocketAddr = "127.0.0.1:8377".parse().unwrap();
        for ok in [
            "localhost",
            "localhost:8377",
            "LOCALHOST:1",
            "127.0.0.1:8377",
            "[::1]:8377",
            "127.0.0.2",
        ] {
            assert!(host_allowed(ok, lo), "{ok}");
        }
        for bad in [
            "evil.example",
            "evil.example:8377",
            "localhost.evil.example",
            "10.0.0.5:8377",
            "[::1",
            "",
        ] {
            assert!(!host_allowed(bad, lo), "{bad}");
        }
        let any: std::net::SocketAddr = "0.0.0.0:80".parse().unwrap();
        assert!(host_allowed("192.168.1.20", any) && !host_allowed("attacker.example", any));
        let lan: std::net::SocketAddr = "192.168.1.20:80".parse().unwrap();
        assert!(host_allowed("192.168.1.20:80", lan) && !host_allowed("192.168.1.21", lan));
    }
}
