fn main() {
    kllm_mount::cli::main();
}
