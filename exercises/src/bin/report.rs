//! `make report`: renders the tables and charts of the last runs in a results folder into its
//! README.md (between the generated section's markers; the hand-written text stays).
//!
//!     report [--results-dir results]
use clap::Parser;

/// Tables and charts of the last runs, into <results-dir>/README.md.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[arg(long, default_value = "results")]
    results_dir: std::path::PathBuf,
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    common::error::run_main(|| {
        let path = common::results_page::update_readme(&cli.results_dir)?;
        println!("wrote {}", path.display());
        Ok(())
    })
}
