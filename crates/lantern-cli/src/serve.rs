//! `lantern serve`: the OpenAI-compatible HTTP server.

use crate::args::EngineArgs;
use anyhow::{Context, Result};
use clap::Args;
use lantern_server::loading::ReadyRoutes;
use lantern_server::{
    CaptureSettings, ConnectionLimits, EngineHandle, EngineLogging, EngineThread, ServerConfig,
};
use std::io::Write;
use std::sync::{Arc, OnceLock};

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// The model, as `vllm serve MODEL` takes it: the same as --model.
    #[arg(value_name = "MODEL", conflicts_with = "model")]
    pub model_arg: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub vllm: Box<crate::vllm_flags::VllmServeFlags>,
    /// Requests that give no `seed` get one from this seed's sequence, in the order they
    /// arrive, as vLLM's `--seed` does: a script's sampling repeats against a fresh server.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 picks a free one; the "listening on" line shows it).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on /v1/* (default: $LANTERN_API_KEY). Repeat
    /// for several clients; a stored capture is readable only with the key that made it.
    #[arg(long)]
    pub api_key: Vec<String>,
    /// The names clients may send as `model` (several after the flag, or the flag
    /// repeated); the first is the one responses, `/v1/models` and metrics report.
    /// Default: --model as given (the default model: `SmolLM2-135M-Instruct.Q4_1`).
    #[arg(long, num_args = 1.., value_name = "NAME")]
    pub served_model_name: Vec<String>,
    /// Most requests waiting to run; a request that would take more sequences than that
    /// into the waiting queue is answered 429 with Retry-After (at least 1: every request
    /// waits, if only until the next step).
    #[arg(long, default_value_t = lantern_engine::config::DEFAULT_MAX_WAITING_REQUESTS, value_parser = crate::args::at_least_one)]
    pub max_waiting_requests: usize,
    /// Let requests ask for their attention maps (`attn_capture`); off by default.
    #[arg(long)]
    pub enable_attention_capture: bool,
    /// Layers captured when a request names none: `all` or a list like `0,7,15`.
    #[arg(long, default_value = "all", value_parser = parse_layer_list)]
    pub attention_capture_layers: LayerList,
    /// Largest capture one request may ask for, in bytes (`256M`, `1G`); larger
    /// requests are refused with the estimate before any work.
    #[arg(long, default_value = crate::args::DEFAULT_MAX_CAPTURE_BYTES, value_parser = crate::args::parse_bytes)]
    pub max_capture_bytes: usize,
    /// Seconds a capture delivered by reference or file is kept.
    #[arg(long, default_value_t = 600)]
    pub capture_ttl: u64,
    /// Origins a browser may call the API from (repeat or comma-separate; `*` for any).
    /// Without it the server sends no CORS headers, so pages of other origins cannot
    /// read its answers (and their JSON POSTs are stopped at the preflight).
    #[arg(long, value_delimiter = ',')]
    pub allowed_origins: Vec<String>,
    /// Most connections open at once; past it a new one is answered 503.
    #[arg(long, default_value_t = lantern_server::connections::DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,
    /// Seconds a client has to send a request's headers (an idle keep-alive connection
    /// is closed after as long).
    #[arg(long, default_value_t = 30.0)]
    pub header_read_timeout: f64,
    /// Seconds a client has to send a whole request body (else 408).
    #[arg(long, default_value_t = 60.0)]
    pub body_read_timeout: f64,
    /// Bytes that captures delivered by reference or file may hold together (`1G`);
    /// while they are full, such requests get a 503 with Retry-After.
    #[arg(long, default_value = "1G", value_parser = crate::args::parse_bytes)]
    pub max_stored_capture_bytes: usize,
    /// Bytes the Responses API's kept responses may take together (`64M`), for
    /// `previous_response_id` and `GET /v1/responses/{id}`; the oldest go first.
    #[arg(long, default_value = "64M", value_parser = crate::args::parse_bytes)]
    pub max_stored_response_bytes: usize,
    /// Finished captures waiting for the capture worker from which new capturing
    /// requests get a 503 with Retry-After (captures admitted before are all finalized).
    #[arg(long, default_value_t = lantern_engine::lantern_capture::DEFAULT_MAX_QUEUED_CAPTURES)]
    pub max_queued_captures: usize,
    /// Directory for captures delivered as files (e.g. a tmpfs such as /dev/shm, for
    /// clients on this host that memory-map large captures); enables delivery "file".
    #[arg(long)]
    pub capture_dir: Option<std::path::PathBuf>,
    /// vLLM's reasoning parser for thinking models (`deepseek_r1`, `qwen3`,
    /// `openai_gptoss`): a chat output's `<think>…</think>` (gpt-oss: its analysis
    /// channel) becomes its message's `reasoning`, and structured output applies to the
    /// answer after it. A vocabulary with harmony's markers implies `openai_gptoss`.
    #[arg(long, value_name = "NAME", value_parser = parse_reasoning_parser)]
    pub reasoning_parser: Option<lantern_server::ReasoningParser>,
    /// Do not log a line per finished request (id, tokens, times, finish reason).
    #[arg(long)]
    pub disable_log_requests: bool,
    /// Do not log the periodic stats line (throughput, running, waiting, KV cache use).
    #[arg(long)]
    pub disable_log_stats: bool,
    /// Seconds between two stats lines while the engine has work.
    #[arg(long, default_value_t = 10.0)]
    pub log_stats_interval: f64,
    /// Tests of fault containment only: panic where told (`panic-at-step:N`,
    /// `panic-at-admission:N`, `panic-at-capture:N`, `panic-at-reset:N`).
    #[arg(long, hide = true)]
    pub inject_fault: Option<lantern_engine::fault::FaultPlan>,
}

fn parse_reasoning_parser(name: &str) -> anyhow::Result<lantern_server::ReasoningParser> {
    lantern_server::ReasoningParser::from_name(name).ok_or_else(|| {
        anyhow::anyhow!(
            "unknown reasoning parser {name:?}; lantern knows {}",
            lantern_server::ReasoningParser::NAMES.join(", ")
        )
    })
}

/// `all`, or a list of layer indices.
#[derive(Debug, Clone)]
pub struct LayerList(Option<Vec<usize>>);

fn parse_layer_list(s: &str) -> Result<LayerList, String> {
    if s.trim() == "all" {
        return Ok(LayerList(None));
    }
    s.split(',')
        .map(|p| {
            p.trim()
                .parse::<usize>()
                .map_err(|_| format!("{p:?} is not a layer index (give `all` or e.g. `0,7,15`)"))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(|layers| LayerList(Some(layers)))
}

/// `--served-model-name`, or else the model as vLLM names it: by `--model` as given.
fn served_model_names(args: &ServeArgs) -> Vec<String> {
    let given: Vec<String> = args
        .served_model_name
        .iter()
        .filter(|n| !n.is_empty())
        .cloned()
        .collect();
    if given.is_empty() {
        vec![args.engine.model_name()]
    } else {
        given
    }
}

pub fn run(mut args: ServeArgs, verbose: bool) -> Result<()> {
    if let Some(model) = args.model_arg.take() {
        args.engine.model = Some(model);
    }
    for note in args.vllm.apply(&mut args.engine)? {
        eprintln!("lantern: {note}");
    }
    let mut api_keys: Vec<String> = args
        .api_key
        .iter()
        .filter(|k| !k.is_empty())
        .cloned()
        .collect();
    if api_keys.is_empty() {
        api_keys.extend(
            std::env::var("LANTERN_API_KEY")
                .ok()
                .filter(|k| !k.is_empty()),
        );
    }
    // As vLLM, an empty key means none; said aloud, since a deploy script whose key
    // variable is unset would otherwise serve openly without a word.
    if api_keys.is_empty() && !args.api_key.is_empty() {
        eprintln!(
            "lantern: warning: --api-key is empty, so the server takes requests without a key"
        );
    }
    if let Some(dir) = &args.capture_dir {
        anyhow::ensure!(
            dir.is_dir(),
            "--capture-dir {} is not a directory",
            dir.display()
        );
    }
    let seconds = |flag: &str, s: f64| {
        anyhow::ensure!(
            s.is_finite() && s > 0.0 && s < 1e9,
            "--{flag} must be a positive number of seconds, got {s}"
        );
        Ok(std::time::Duration::from_secs_f64(s))
    };
    let header_read_timeout = seconds("header-read-timeout", args.header_read_timeout)?;
    let body_read_timeout = seconds("body-read-timeout", args.body_read_timeout)?;
    anyhow::ensure!(
        args.max_connections > 0,
        "--max-connections must be at least 1"
    );
    let stats_interval = seconds("log-stats-interval", args.log_stats_interval)?;
    let logging = EngineLogging {
        requests: !args.disable_log_requests,
        stats_interval: (!args.disable_log_stats).then_some(stats_interval),
    };
    let faults = args.inject_fault.clone().unwrap_or_default();
    let config = ServerConfig {
        api_keys,
        served_model_names: served_model_names(&args),
        model_root: Some(args.engine.model_as_given()),
        capture: CaptureSettings {
            enabled: args.enable_attention_capture,
            default_layers: args.attention_capture_layers.0.clone(),
            max_bytes: args.max_capture_bytes as u64,
            ttl: std::time::Duration::from_secs(args.capture_ttl),
            dir: args.capture_dir.clone(),
            max_stored_bytes: args.max_stored_capture_bytes as u64,
            max_queued: args.max_queued_captures,
            fault: faults.capture,
        },
        body_read_timeout,
        max_stored_response_bytes: args.max_stored_response_bytes,
        reasoning_parser: args.reasoning_parser,
        seed: args.seed,
        allowed_origins: args.allowed_origins.clone(),
        connections: ConnectionLimits {
            header_read_timeout,
            max_connections: args.max_connections,
        },
        ..ServerConfig::default()
    };
    // The HTTP side waits on sockets and the engine: it needs no more threads than
    // the compute pool, whose --threads also bounds it (tokio's default is every CPU).
    let http_workers = args
        .engine
        .threads
        .map_or_else(lantern_quant::threads::default_compute_threads, usize::from);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(http_workers.max(1))
        .enable_all()
        .thread_name("lantern-http")
        .build()
        .context("starting the async runtime")?;
    // The engine, once loaded: the signal handler ends its requests.
    let loaded: Arc<OnceLock<(EngineHandle, EngineThread)>> = Arc::new(OnceLock::new());
    let result = runtime.block_on(serve_while_loading(
        &args, verbose, &config, logging, &loaded,
    ));
    if let Some(engine) = Arc::into_inner(loaded).and_then(OnceLock::into_inner) {
        let (engine, engine_thread) = engine;
        engine.shutdown();
        drop(engine);
        engine_thread.join();
    }
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    result
}

/// Binds the port first, answering as loading (`/health` 503) while the model loads on
/// a blocking thread, then serves the real routes until a signal.
async fn serve_while_loading(
    args: &ServeArgs,
    verbose: bool,
    config: &ServerConfig,
    logging: EngineLogging,
    loaded: &Arc<OnceLock<(EngineHandle, EngineThread)>>,
) -> Result<()> {
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("binding {}:{}", args.host, args.port))?;
    let addr = listener.local_addr()?;
    println!("lantern: loading the model; http://{addr}/health answers 503 until it is ready");
    std::io::stdout().flush().ok();
    let ready: ReadyRoutes = Arc::new(OnceLock::new());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let on_signal = loaded.clone();
    let server = tokio::spawn(lantern_server::serve_with_limits(
        listener,
        lantern_server::loading::gate(ready.clone()),
        config.connections,
        async move {
            tokio::select! {
                _ = shutdown_signal() => eprintln!("lantern: shutting down"),
                _ = stop_rx => {}
            }
            // Ends every request (their streams finish with `abort`), so the graceful
            // shutdown does not wait on long generations.
            if let Some((engine, _)) = on_signal.get() {
                engine.shutdown();
            }
        },
    ));
    let engine_args = args.engine.clone();
    let mut engine_config = engine_args.engine_config();
    engine_config.max_waiting_requests = args.max_waiting_requests;
    let engine_faults = args.inject_fault.clone().unwrap_or_default();
    let load = tokio::task::spawn_blocking(move || {
        EngineHandle::start_logging(
            move || {
                let mut engine = engine_args.build_engine_with(verbose, engine_config)?;
                if engine.shared_chat_template().is_none() {
                    // Said once at start, so that an operator need not wait for a 400.
                    tracing::warn!(
                        "the model has no chat template: /v1/chat/completions will answer 400 \
                         until the server is started with --chat-template FILE; \
                         /v1/completions works"
                    );
                }
                engine.set_fault_plan(engine_faults);
                Ok::<_, anyhow::Error>(engine)
            },
            logging,
        )
    });
    let built = tokio::select! {
        built = load => Some(built.context("loading the model")?),
        // A signal while loading ends the server; the load is abandoned with the process.
        () = until_finished(&server) => None,
    };
    let Some(built) = built else {
        eprintln!("lantern: stopped before the model finished loading");
        return Ok(());
    };
    let (engine, engine_thread) = match built {
        Ok(built) => built,
        Err(e) => {
            let _ = stop_tx.send(());
            let _ = server.await;
            return Err(e);
        }
    };
    let meta = engine.meta();
    if let Some(bad) = args
        .attention_capture_layers
        .0
        .iter()
        .flatten()
        .find(|&&l| l >= meta.num_layers)
    {
        let layers = meta.num_layers;
        engine.shutdown();
        engine_thread.join();
        let _ = stop_tx.send(());
        let _ = server.await;
        anyhow::bail!(
            "--attention-capture-layers names layer {bad}, but the model has {layers} layers"
        );
    }
    if !meta.sampling_defaults.is_empty() {
        // As vLLM says it: the defaults change what a request without them samples.
        println!(
            "lantern: requests that leave them out sample with the model's generation_config.json defaults: {} (--generation-config vllm for none)",
            meta.sampling_defaults
        );
    }
    let routes =
        lantern_server::router(engine.clone(), config).context("starting the capture worker")?;
    let _ = loaded.set((engine, engine_thread));
    let _ = ready.set(routes);
    println!("lantern: serving {}", config.served_model_names.join(", "));
    println!("lantern: listening on http://{addr}");
    std::io::stdout().flush().ok();
    let _keep_open = stop_tx;
    server
        .await
        .context("the HTTP server task failed")?
        .context("serving HTTP")
}

/// Resolves when the server task has ended.
async fn until_finished(server: &tokio::task::JoinHandle<std::io::Result<()>>) {
    while !server.is_finished() {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
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
