//! The `attnscope` command: the binary's own crate. [`cli`] parses the arguments into a command's
//! options, calls the library's `commands`, and prints; the benchmarks (`bench`) and the local
//! server (`serve`) live there too.

mod cli;

// The system allocator: a custom one (big buffers mapped with MAP_POPULATE and cached) was
// measured against it and against mimalloc and did not win by 10% on anything (issue #15's note).
fn main() -> std::process::ExitCode {
    // a panic is attnscope's bug (third-party readers' panics are caught at the loader boundary
    // and reported as the file's): said so on standard error, and its own exit code
    attnscope::model::guard::report_bugs();
    std::panic::catch_unwind(cli::main).unwrap_or(std::process::ExitCode::from(
        attnscope::model::guard::BUG_EXIT,
    ))
}
