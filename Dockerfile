# Builds the ferry binary and runs it on a slim Debian.
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin ferry

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates git \
    && rm -rf /var/lib/apt/lists/* && useradd --system --home /var/lib/ferry ferry \
    && mkdir -p /var/lib/ferry && chown ferry /var/lib/ferry
COPY --from=build /src/target/release/ferry /usr/local/bin/ferry
USER ferry
ENV FERRY_DATA_DIR=/var/lib/ferry FERRY_HTTP_ADDR=0.0.0.0:8080
EXPOSE 8080
ENTRYPOINT ["ferry"]
CMD ["serve"]
