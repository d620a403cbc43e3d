mod alloc;

#[global_allocator]
static GLOBAL: alloc::BigBufferAlloc = alloc::BigBufferAlloc;

fn main() -> std::process::ExitCode {
    attnscope::cli::main()
}
