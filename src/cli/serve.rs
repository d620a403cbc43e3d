//! `attnscope serve`: a local page to type a sentence and explore the views. The model is loaded
//! once; the server binds loopback by default and bounds the request size, the text and the
//! number of requests in flight (more get 503 at once rather than queueing without limit).

use super::common::{emit, usage, ModelArgs};
use crate::render::html::html_escape;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
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
    /// Requests handled at once; more are answered 503 immediately.
    #[arg(long, default_value_t = 4)]
    max_concurrent: usize,
    /// Seconds a client has to send its whole request (slow clients are cut off after it).
    #[arg(long, default_value_t = 10)]
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
<p><label><input type="checkbox" name="faithfulness" value="1"> also measure faithfulness (slower)</label></p><button type="submit">Show attention</button></form>ERROR</body></html>"#;

fn form(model: &str, max_chars: usize, error: Option<&str>) -> String {
    FORM.replace("MODEL", &html_escape(model))
        .replace("MAXCHARS", &max_chars.to_string())
        .replace(
            "ERROR",
            &error
                .map(|e| format!("<p class=\"err\">{}</p>", html_escape(e)))
                .unwrap_or_default(),
        )
}

/// One slot of `--max-concurrent`, given back when dropped: also when its handler panics.
struct Slot(Arc<AtomicUsize>);

impl Slot {
    /// A slot if fewer than `max` are taken.
    fn take(busy: &Arc<AtomicUsize>, max: usize) -> Option<Slot> {
        busy.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |b| {
            (b < max).then_some(b + 1)
        })
        .ok()
        .map(|_| Slot(busy.clone()))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
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
    let head = format!("HTTP/1.1 {status}\r\nContent-Type: text/html; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\nX-Content-Type-Options: nosniff\r\n\r\n", body.len());
    let mut out = Deadline {
        stream,
        until: Instant::now() + Duration::from_secs(WRITE_DEADLINE_S),
    };
    let _ = out
        .write_all(head.as_bytes())
        .and_then(|_| out.write_all(body.as_bytes()));
}

fn handle(
    stream: &mut TcpStream,
    model: &crate::model::Model,
    a: &Args,
    bound: std::net::SocketAddr,
) {
    let until = Instant::now() + Duration::from_secs(a.request_timeout);
    let mut reader = BufReader::new(Deadline { stream, until });
    let mut line = String::new();
    match reader
        .by_ref()
        .take(MAX_REQUEST_LINE as u64)
        .read_line(&mut line)
    {
        Ok(_) if line.ends_with('\n') => {}
        _ => {
            return respond(
                stream,
                "400 Bad Request",
                &form(
                    &model.info.name,
                    a.max_chars,
                    Some("the request line is too long or incomplete"),
                ),
            )
        }
    }
    // read (and bound) the headers; the body, if any, is ignored: every request is a GET
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
                    return respond(
                        stream,
                        "431 Request Header Fields Too Large",
                        &form(
                            &model.info.name,
                            a.max_chars,
                            Some("the request headers are too large"),
                        ),
                    );
                }
            }
            Err(_) => {
                return respond(
                    stream,
                    "400 Bad Request",
                    &form(
                        &model.info.name,
                        a.max_chars,
                        Some("the request could not be read"),
                    ),
                )
            }
        }
    }
    drop(reader);
    match host {
        Some(h) if host_allowed(&h, bound) => {}
        Some(h) => {
            return respond(
                stream,
                "421 Misdirected Request",
                &form(
                    &model.info.name,
                    a.max_chars,
                    Some(&format!("this server answers to localhost, not to `{h}`")),
                ),
            )
        }
        None => {
            return respond(
                stream,
                "400 Bad Request",
                &form(
                    &model.info.name,
                    a.max_chars,
                    Some("the request has no Host header"),
                ),
            )
        }
    }
    let mut parts = line.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    if method != "GET" {
        return respond(
            stream,
            "405 Method Not Allowed",
            &form(&model.info.name, a.max_chars, Some("only GET is supported")),
        );
    }
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    match path {
        "/" => respond(stream, "200 OK", &form(&model.info.name, a.max_chars, None)),
        // browsers ask for it on their own; an empty answer keeps their consoles clean
        "/favicon.ico" => respond(stream, "204 No Content", ""),
        "/view" => {
            let mut text = None;
            let mut faith = false;
            for (k, v) in form_urlencoded::parse(query.as_bytes()) {
                match k.as_ref() {
                    "text" => text = Some(v.into_owned()),
                    "faithfulness" => faith = v == "1",
                    _ => {}
                }
            }
            let Some(text) = text else {
                return respond(
                    stream,
                    "400 Bad Request",
                    &form(&model.info.name, a.max_chars, Some("no text was given")),
                );
            };
            if text.chars().count() > a.max_chars {
                return respond(
                    stream,
                    "413 Payload Too Large",
                    &form(
                        &model.info.name,
                        a.max_chars,
                        Some(&format!(
                            "the text has {} characters; this server takes at most {}",
                            text.chars().count(),
                            a.max_chars
                        )),
                    ),
                );
            }
            if faith {
                match model.encode(&text, a.model.bos) {
                    Ok(t) if t.len() > a.max_faithfulness_tokens => {
                        let msg = format!("the text is {} tokens; this server measures faithfulness (one forward per token) on at most {} (--max-faithfulness-tokens); untick it, or run `attnscope faithfulness`", t.len(), a.max_faithfulness_tokens);
                        return respond(
                            stream,
                            "413 Payload Too Large",
                            &form(&model.info.name, a.max_chars, Some(&msg)),
                        );
                    }
                    _ => {}
                }
            }
            match super::view::view_html(model, &text, a.model.bos, faith) {
                Ok((html, _)) => respond(stream, "200 OK", &html),
                Err(e) => respond(
                    stream,
                    "400 Bad Request",
                    &form(&model.info.name, a.max_chars, Some(&format!("{e:#}"))),
                ),
            }
        }
        _ => respond(
            stream,
            "404 Not Found",
            &form(
                &model.info.name,
                a.max_chars,
                Some(&format!("there is no page {path}")),
            ),
        ),
    }
}

pub fn run(a: Args) -> anyhow::Result<()> {
    if a.max_concurrent == 0 || a.max_chars == 0 || a.request_timeout == 0 {
        return Err(usage(
            "--max-concurrent, --max-chars and --request-timeout must be at least 1",
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
    let busy = Arc::new(AtomicUsize::new(0));
    let a = Arc::new(a);
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else { continue };
        let Some(slot) = Slot::take(&busy, a.max_concurrent) else {
            // answered on a thread of its own, so a client that does not read cannot stall the loop
            let (name, max_chars) = (model.info.name.clone(), a.max_chars);
            std::thread::spawn(move || {
                respond(
                    &mut stream,
                    "503 Service Unavailable",
                    &form(
                        &name,
                        max_chars,
                        Some("the server is busy; try again in a moment"),
                    ),
                )
            });
            continue;
        };
        let (model, a) = (model.clone(), a.clone());
        std::thread::spawn(move || {
            // the slot is given back when this thread ends, by return or by panic
            let _slot = slot;
            handle(&mut stream, &model, &a, local);
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_is_given_back_even_when_its_handler_panics() {
        let busy = Arc::new(AtomicUsize::new(0));
        let a = Slot::take(&busy, 2).unwrap();
        let b = Slot::take(&busy, 2).unwrap();
        assert!(Slot::take(&busy, 2).is_none(), "a third slot of two");
        let t = std::thread::spawn(move || {
            let _slot = b;
            panic!("a handler panics");
        });
        assert!(t.join().is_err());
        assert_eq!(busy.load(Ordering::SeqCst), 1);
        assert!(Slot::take(&busy, 2).is_some());
        drop(a);
        assert_eq!(busy.load(Ordering::SeqCst), 0);
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
