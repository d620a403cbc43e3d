fn main() -> std::process::ExitCode {
    attnscope::cli::main()
}
