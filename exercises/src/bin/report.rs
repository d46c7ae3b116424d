//! `make report`: renders the tables and charts of the last runs in a results folder into its
//! README.md (between the generated section's markers; the hand-written text stays).
//! `make scaling`: `report scaling` collects the scaling study's runs into a table and a chart.
//!
//!     report [--results-dir results]
//!     report scaling [--results-dir results] [--runs results/scaling]
//!     report ps [--results-dir results]      (`make bench-ps`'s chart)
use std::path::PathBuf;

use clap::{Parser, Subcommand};

/// Tables and charts of the last runs, into <results-dir>/README.md.
#[derive(Parser)]
#[command(version)]
struct Cli {
    #[arg(long, default_value = "results", global = true)]
    results_dir: PathBuf,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// The scaling study: the runs under --runs (<mode>/<folder>/<run>.json, mode strong or
    /// weak) into <results-dir>/scaling.csv and scaling.svg (speed-up, efficiency against the
    /// ideal, time per epoch, all-reduce share), and the table on the terminal.
    Scaling {
        /// Where the runs are [default: <results-dir>/scaling].
        #[arg(long)]
        runs: Option<PathBuf>,
    },
    /// `make bench-ps`: the newest run of each strategy in <results-dir>/bench-ps.csv drawn
    /// into bench-ps.svg (throughput beside test accuracy).
    Ps,
    /// `make bench-plan`: the newest bench of each cluster in <results-dir>/bench-plan.csv,
    /// the planner's predictions against the runs summarized, and drawn into bench-plan.svg.
    Plan,
}

fn main() -> std::process::ExitCode {
    let cli = common::cli::parse::<Cli>();
    common::error::run_main(|| {
        match cli.command {
            None => {
                let updated = common::results_page::update_readme(&cli.results_dir)?;
                for file in &updated.unreadable {
                    eprintln!("warning: left out of the report, could not read {file}");
                }
                println!("wrote {}", updated.readme.display());
            }
            Some(Command::Scaling { runs }) => {
                let runs = runs.unwrap_or_else(|| cli.results_dir.join("scaling"));
                let out = common::scaling::collect(&runs, &cli.results_dir)?;
                print!("{}", common::scaling::markdown(&out.rows));
                println!("wrote {} and {}", out.csv.display(), out.svg.display());
            }
            Some(Command::Plan) => {
                let (summaries, svg) = common::plan::check::report(&cli.results_dir)?;
                for (cluster, summary) in &summaries {
                    println!("{}", summary.describe(cluster));
                }
                println!("wrote {}", svg.display());
            }
            Some(Command::Ps) => {
                let (rows, svg) = common::ps_bench::collect(&cli.results_dir)?;
                println!("wrote {} ({} strategies)", svg.display(), rows.len());
            }
        }
        Ok(())
    })
}
