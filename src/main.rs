// The system allocator: a custom one (big buffers mapped with MAP_POPULATE and cached) was
// measured against it and against mimalloc and did not win by 10% on anything (issue #15's note).
fn main() -> std::process::ExitCode {
    attnscope::cli::main()
}
