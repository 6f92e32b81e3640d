//! The `lantern` binary.

mod args;
mod attn;
mod bench;
mod bench_capture;
mod bench_scaling;
mod generate;
mod generate_beam;
mod generate_capture;
mod kernels;
mod serve;
mod vllm_flags;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "lantern",
    version,
    about = "An LLM serving engine with exact per-request attention capture",
    after_help = ENVIRONMENT
)]
struct Cli {
    /// Log more (CPU level, KV cache size, timings) to stderr.
    #[arg(long, short, global = true)]
    verbose: bool,
    #[command(subcommand)]
    command: Command,
}

/// The environment variables lantern reads, for `--help`.
const ENVIRONMENT: &str = "Environment:
  LANTERN_KERNELS    Kernel level, capped at what the CPU has: scalar, avx2, avx-vnni,
                     avx512, amx (default: the best of these), or avx512-bf16 and
                     amx-bf16 (opt-in: BF16 weights' products round the activations
                     to bf16, and at amx-bf16 attention runs in bf16 on AMX tiles;
                     faster but no longer bit-identical with the other levels)
  LANTERN_CACHE_DIR  Where the default model is fetched to (default:
                     $XDG_CACHE_HOME/lantern or ~/.cache/lantern)
  LANTERN_API_KEY    serve: the API key when --api-key is not given
  RAYON_NUM_THREADS  Compute threads when --threads is not given (default: the
                     physical cores this process may use)";

#[derive(Subcommand)]
enum Command {
    /// Generate text for one or more prompts, batched together.
    Generate(generate::GenerateArgs),
    /// Serve the model over an OpenAI-compatible HTTP API.
    Serve(serve::ServeArgs),
    /// Measure prefill and decode throughput.
    Bench(bench::BenchArgs),
    /// Look at an attention capture (an HTML heatmap) or convert it (npy, safetensors).
    Attn(attn::AttnArgs),
}

fn main() {
    let matches = Cli::command().get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    init_logging(cli.verbose);
    if !matches!(cli.command, Command::Serve(_)) {
        end_quietly_on_a_closed_pipe();
    }
    let result = match cli.command {
        Command::Generate(args) => {
            let sub = matches
                .subcommand_matches("generate")
                .expect("generate was parsed");
            generate::run(args, sub, cli.verbose)
        }
        Command::Serve(args) => serve::run(args, cli.verbose),
        Command::Bench(args) => bench::run(args, cli.verbose),
        Command::Attn(args) => attn::run(args),
    };
    if let Err(e) = result {
        eprintln!("error: {}", error_chain(&e));
        std::process::exit(1);
    }
}

/// A command whose output goes to a pipe its reader closed (`| head`) ends as other
/// command-line tools do, by SIGPIPE, instead of panicking on the failed write (Rust
/// ignores SIGPIPE). Not for `serve`, whose writes to closed sockets are errors it handles.
fn end_quietly_on_a_closed_pipe() {
    // SAFETY: setting a signal's disposition to the default before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// An error and its causes, as `{:#}` writes them, without the causes whose text the
/// message before them already holds (errors that write their source into their own
/// message would otherwise say it twice).
fn error_chain(e: &anyhow::Error) -> String {
    let mut text = e.to_string();
    for cause in e.chain().skip(1) {
        let cause = cause.to_string();
        if !text.contains(&cause) {
            text.push_str(": ");
            text.push_str(&cause);
        }
    }
    text
}

fn init_logging(verbose: bool) {
    // The request log and the stats line are on by default, as vLLM's are.
    let default = if verbose {
        "info"
    } else {
        "warn,lantern::requests=info,lantern::stats=info"
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("LANTERN_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn subcommand(name: &str) -> clap::Command {
        Cli::command()
            .find_subcommand(name)
            .unwrap_or_else(|| panic!("no subcommand {name}"))
            .clone()
    }

    fn has_arg(command: &clap::Command, id: &str) -> bool {
        command.get_arguments().any(|a| a.get_id() == id)
    }

    #[test]
    fn max_waiting_requests_is_a_serve_option_only() {
        assert!(has_arg(&subcommand("serve"), "max_waiting_requests"));
        for name in ["generate", "bench"] {
            assert!(
                !has_arg(&subcommand(name), "max_waiting_requests"),
                "{name}"
            );
        }
    }

    #[test]
    fn every_option_says_what_it_does() {
        for name in ["generate", "serve", "bench", "attn"] {
            let command = subcommand(name);
            for arg in command.get_arguments().filter(|a| !a.is_hide_set()) {
                assert!(
                    arg.get_help().is_some(),
                    "lantern {name} --{} has no description",
                    arg.get_id()
                );
            }
        }
    }
}
