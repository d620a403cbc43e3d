//! The loader boundary and internal errors. A panic inside a third-party reader (candle's GGUF
//! and safetensors parsing, the tokenizers crate) handed bytes it did not expect becomes an
//! error naming the file ([`quietly`] wraps those calls, and only those); a panic anywhere else
//! is attnscope's own bug, and the command says so and exits with [`BUG_EXIT`] ([`report_bugs`]),
//! never blaming the user's file.

use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Once;

/// The exit code of a command that hit a bug in attnscope (a panic): 70, `EX_SOFTWARE` of
/// sysexits.h ("internal software error"), apart from 1 (a failure) and 2 (bad input).
pub const BUG_EXIT: u8 = 70;

thread_local! {
    static QUIET: Cell<bool> = const { Cell::new(false) };
}

/// Whether panics outside [`quietly`] are reported as attnscope's bugs (the command line).
static REPORT_BUGS: AtomicBool = AtomicBool::new(false);

/// The one panic hook: silent inside [`quietly`] (on its thread), the bug report once
/// [`report_bugs`] asked for it, else whatever hook was there before.
fn install_hook() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if QUIET.with(Cell::get) {
                return;
            }
            if REPORT_BUGS.load(Ordering::SeqCst) {
                let msg = message(info.payload());
                let at = info
                    .location()
                    .map(|l| format!(" at {}:{}", l.file(), l.line()))
                    .unwrap_or_default();
                eprintln!(
                    "attnscope: internal error: {msg}{at}\nattnscope: this is a bug in attnscope {}, not a problem with your input or your model file; please report it with the command you ran (exit code {BUG_EXIT})",
                    env!("CARGO_PKG_VERSION")
                );
            } else {
                previous(info)
            }
        }));
    });
}

/// From now on a panic outside [`quietly`] prints that it is a bug in attnscope (with where it
/// happened) instead of Rust's panic message; the caller exits with [`BUG_EXIT`].
pub fn report_bugs() {
    REPORT_BUGS.store(true, Ordering::SeqCst);
    install_hook();
}

fn message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_string())
}

/// Runs `f`, a call into a third-party reader; a panic inside it comes back as `Err(message)`,
/// and the panic hook stays silent for it (other threads' panics are reported as usual). Only
/// for code that is not attnscope's: a bug of attnscope's own must not be reported as a bad file.
pub fn quietly<R>(f: impl FnOnce() -> R) -> Result<R, String> {
    install_hook();
    let was = QUIET.with(|q| q.replace(true));
    let r = catch_unwind(AssertUnwindSafe(f));
    QUIET.with(|q| q.set(was));
    r.map_err(|p| message(p.as_ref()))
}

/// Panics (a stand-in for a bug of attnscope's own) when `ATTNSCOPE_FAULT` names `site`: the
/// tests check with it that such a panic is reported as a bug, not as a damaged file. Sites:
/// `pack` (loading, after the first layer's projections are packed).
pub fn fault_point(site: &str) {
    static FAULT: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let fault = FAULT.get_or_init(|| std::env::var("ATTNSCOPE_FAULT").ok());
    if fault.as_deref() == Some(site) {
        panic!("fault injected at `{site}` (ATTNSCOPE_FAULT)");
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_panic_becomes_its_message() {
        assert_eq!(super::quietly(|| 3), Ok(3));
        let r: Result<(), String> = super::quietly(|| panic!("divide by {}", 0));
        assert_eq!(r, Err("divide by 0".to_string()));
        // the flag is restored: a second call works the same
        assert_eq!(
            super::quietly(|| -> u8 { panic!("x") }),
            Err("x".to_string())
        );
    }
}
