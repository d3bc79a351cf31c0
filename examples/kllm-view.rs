//! Write the view a mount of SEALED must show into OUT, built in process without the
//! kernel: the expected files for tests that read a real mount from somewhere else (a
//! container, an fstab mount). The in-process view is itself held to the shared vectors
//! by tests/core_vectors.rs. Test data only: it writes decoded bytes to disk.
//!
//!   kllm-view SEALED OUT --key KEYFILE

use std::path::PathBuf;

use clap::Parser;
use kllm_mount::key;
use kllm_mount::sealed::{self, Options};

#[derive(Parser)]
#[command(
    name = "kllm-view",
    about = "write the expected view of a sealed directory"
)]
struct Cli {
    sealed: PathBuf,
    out: PathBuf,
    #[arg(long)]
    key: PathBuf,
}

fn die(msg: String) -> ! {
    eprintln!("kllm-view: {msg}");
    std::process::exit(1)
}

fn main() {
    let cli = Cli::parse();
    let (model_key, source) = key::resolve(
        Some(&cli.key),
        &cli.sealed,
        &key::passphrase_from_env_or_prompt,
    )
    .unwrap_or_else(|e| die(e.to_string()));
    let view = sealed::open(&cli.sealed, &model_key, &source, &Options::with_cache(0))
        .unwrap_or_else(|e| die(e.to_string()));
    for (rel, ino) in view.file_paths() {
        let size = view.node(ino).map_or(0, |n| n.attr.size) as usize;
        let bytes = view
            .read(ino, 0, size)
            .unwrap_or_else(|e| die(format!("{rel}: {e:?}")));
        let to = cli.out.join(&rel);
        std::fs::create_dir_all(to.parent().expect("a file has a parent"))
            .and_then(|()| std::fs::write(&to, &*bytes))
            .unwrap_or_else(|e| die(format!("{}: {e}", to.display())));
    }
}
