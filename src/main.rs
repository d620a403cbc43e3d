mod alloc;

#[global_allocator]
static GLOBAL: alloc::HugePageAlloc = alloc::HugePageAlloc;

fn main() -> std::process::ExitCode {
    attnscope::cli::main()
}
