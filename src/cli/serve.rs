//! `attnscope serve`: a local page to type a sentence and explore the views. The model is loaded
//! once; the server binds loopback by default and bounds the request size, the text and the
//! number of requests in flight (more get 503 at once rather than queueing without limit).

use super::common::{emit, usage, ModelArgs};
use crate::render::html::html_escape;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

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
}

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
        .replace("ERROR", &error.map(|e| format!("<p class=\"err\">{}</p>", html_escape(e))).unwrap_or_default())
}

/// Decodes `application/x-www-form-urlencoded` (`+` is a space, `%XX` a byte).
pub fn url_decode(s: &str) -> Result<String, String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = s.get(i + 1..i + 3).ok_or("a truncated %-escape")?;
                out.push(u8::from_str_radix(hex, 16).map_err(|_| format!("a bad %-escape %{hex}"))?);
                i += 2;
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8(out).map_err(|_| "the text is not valid UTF-8".to_string())
}

fn respond(stream: &mut TcpStream, status: &str, body: &str) {
    let head = format!("HTTP/1.1 {status}\r\nContent-Type: text/html; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\nX-Content-Type-Options: nosniff\r\n\r\n", body.len());
    let _ = stream.write_all(head.as_bytes()).and_then(|_| stream.write_all(body.as_bytes()));
}

fn handle(stream: &mut TcpStream, model: &crate::model::Model, a: &Args) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    let mut reader = BufReader::new(stream.try_clone().expect("a TCP stream clones"));
    let mut line = String::new();
    match reader.by_ref().take(MAX_REQUEST_LINE as u64).read_line(&mut line) {
        Ok(_) if line.ends_with('\n') => {}
        _ => return respond(stream, "400 Bad Request", &form(&model.info.name, a.max_chars, Some("the request line is too long or incomplete"))),
    }
    // read (and bound) the headers; the body, if any, is ignored: every request is a GET
    let mut total = 0;
    loop {
        let mut h = String::new();
        match reader.by_ref().take(MAX_HEADERS as u64).read_line(&mut h) {
            Ok(0) => break,
            Ok(k) => {
                total += k;
                if h == "\r\n" || h == "\n" {
                    break;
                }
                if total > MAX_HEADERS {
                    return respond(stream, "431 Request Header Fields Too Large", &form(&model.info.name, a.max_chars, Some("the request headers are too large")));
                }
            }
            Err(_) => return respond(stream, "400 Bad Request", &form(&model.info.name, a.max_chars, Some("the request could not be read"))),
        }
    }
    let mut parts = line.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    if method != "GET" {
        return respond(stream, "405 Method Not Allowed", &form(&model.info.name, a.max_chars, Some("only GET is supported")));
    }
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    match path {
        "/" => respond(stream, "200 OK", &form(&model.info.name, a.max_chars, None)),
        // browsers ask for it on their own; an empty answer keeps their consoles clean
        "/favicon.ico" => respond(stream, "204 No Content", ""),
        "/view" => {
            let mut text = None;
            let mut faith = false;
            for kv in query.split('&') {
                let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
                match k {
                    "text" => text = Some(url_decode(v)),
                    "faithfulness" => faith = v == "1",
                    _ => {}
                }
            }
            let text = match text {
                Some(Ok(t)) => t,
                Some(Err(e)) => return respond(stream, "400 Bad Request", &form(&model.info.name, a.max_chars, Some(&format!("the text could not be read: {e}")))),
                None => return respond(stream, "400 Bad Request", &form(&model.info.name, a.max_chars, Some("no text was given"))),
            };
            if text.chars().count() > a.max_chars {
                return respond(stream, "413 Payload Too Large", &form(&model.info.name, a.max_chars, Some(&format!("the text has {} characters; this server takes at most {}", text.chars().count(), a.max_chars))));
            }
            match super::view::view_html(model, &text, false, faith) {
                Ok((html, _)) => respond(stream, "200 OK", &html),
                Err(e) => respond(stream, "400 Bad Request", &form(&model.info.name, a.max_chars, Some(&format!("{e:#}")))),
            }
        }
        _ => respond(stream, "404 Not Found", &form(&model.info.name, a.max_chars, Some(&format!("there is no page {path}")))),
    }
}

pub fn run(a: Args) -> anyhow::Result<()> {
    if a.max_concurrent == 0 || a.max_chars == 0 {
        return Err(usage("--max-concurrent and --max-chars must be at least 1"));
    }
    let listener = TcpListener::bind(&a.addr).map_err(|e| usage(format!("cannot listen on {}: {e}", a.addr)))?;
    let local = listener.local_addr()?;
    let model = Arc::new(a.model.load()?);
    if !local.ip().is_loopback() {
        eprintln!("attnscope: warning: listening on {local}, which other machines may reach");
    }
    emit(&format!("attnscope serving {} on http://{local}/ (Ctrl-C to stop)\n", model.info.name))?;
    let busy = Arc::new(AtomicUsize::new(0));
    let a = Arc::new(a);
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else { continue };
        if busy.fetch_add(1, Ordering::SeqCst) >= a.max_concurrent {
            busy.fetch_sub(1, Ordering::SeqCst);
            respond(&mut stream, "503 Service Unavailable", &form(&model.info.name, a.max_chars, Some("the server is busy; try again in a moment")));
            continue;
        }
        let (model, busy, a) = (model.clone(), busy.clone(), a.clone());
        std::thread::spawn(move || {
            handle(&mut stream, &model, &a);
            busy.fetch_sub(1, Ordering::SeqCst);
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn url_decoding() {
        assert_eq!(super::url_decode("H%C3%A0+N%E1%BB%99i").unwrap(), "Hà Nội");
        assert!(super::url_decode("%zz").is_err());
        assert!(super::url_decode("%e1").is_err());
    }
}
