//! `lantern serve`: the OpenAI-compatible HTTP server.

use crate::args::EngineArgs;
use anyhow::{Context, Result};
use clap::Args;
use lantern_server::{EngineHandle, ServerConfig};
use std::io::Write;

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 picks a free one; the "listening on" line shows it).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on /v1/* (default: $LANTERN_API_KEY).
    #[arg(long)]
    pub api_key: Option<String>,
    /// The model name clients send (default: the model's own name).
    #[arg(long)]
    pub served_model_name: Option<String>,
}

pub fn run(args: ServeArgs, verbose: bool) -> Result<()> {
    let api_key = args
        .api_key
        .clone()
        .or_else(|| std::env::var("LANTERN_API_KEY").ok())
        .filter(|k| !k.is_empty());
    let engine_args = args.engine.clone();
    let (engine, engine_thread) = EngineHandle::start(move || engine_args.build_engine(verbose))?;
    let config = ServerConfig {
        api_key,
        served_model_name: args.served_model_name.clone(),
        ..ServerConfig::default()
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("lantern-http")
        .build()
        .context("starting the async runtime")?;
    let result = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
            .await
            .with_context(|| format!("binding {}:{}", args.host, args.port))?;
        let addr = listener.local_addr()?;
        let router = lantern_server::router(engine.clone(), &config);
        let name = engine.meta().name.clone();
        println!("lantern: serving {name}");
        println!("lantern: listening on http://{addr}");
        std::io::stdout().flush().ok();
        let on_signal = engine.clone();
        lantern_server::serve(listener, router, async move {
            shutdown_signal().await;
            eprintln!("lantern: shutting down");
            // Ends every request (their streams finish with `abort`), so the graceful
            // shutdown does not wait on long generations.
            on_signal.shutdown();
        })
        .await
        .context("serving HTTP")
    });
    engine.shutdown();
    drop(engine);
    engine_thread.join();
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    result
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = terminate => {},
    }
}
