//! A real `lantern serve` on 127.0.0.1 for the server's integration tests.

use lantern_engine::Engine;
use lantern_server::{router, serve, EngineHandle, ServerConfig};

pub type BuildError = Box<dyn std::error::Error + Send + Sync>;

/// Starts the engine `build` makes behind the default router on a free port, on a
/// thread of its own with `worker_threads` runtime threads; returns `http://ADDR`.
pub fn spawn_server(
    build: impl FnOnce() -> Result<Engine, BuildError> + Send + 'static,
    worker_threads: usize,
) -> String {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let (engine, _thread) = EngineHandle::start(build).expect("engine starts");
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(worker_threads)
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(format!("http://{}", listener.local_addr().unwrap()))
                .unwrap();
            let app = router(engine, &ServerConfig::default()).unwrap();
            serve(listener, app, std::future::pending()).await.unwrap();
        });
    });
    rx.recv().unwrap()
}
