//! The loader boundary: a panic inside a dependency (a file reader handed bytes it did not
//! expect) becomes an error here instead of a crash, and prints nothing on its way.

use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Once;

thread_local! {
    static QUIET: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f`; a panic inside it comes back as `Err(message)`, and the panic hook stays silent
/// for it (other threads' panics are reported as usual).
pub fn quietly<R>(f: impl FnOnce() -> R) -> Result<R, String> {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !QUIET.with(Cell::get) {
                previous(info)
            }
        }));
    });
    let was = QUIET.with(|q| q.replace(true));
    let r = catch_unwind(AssertUnwindSafe(f));
    QUIET.with(|q| q.set(was));
    r.map_err(|p| {
        p.downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".to_string())
    })
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
