# The S3 server of the distributed stack (docker-compose.yml's object-store service): SeaweedFS
# built from its Go module at the version `duality up --object-store` builds
# (duality.local.object_store.VERSION; tests/unit/test_compose.py compares them), the way that
# module builds it: its source from the Go module proxy (`go install` is refused: its go.mod has
# replace directives), then `go build ./weed` in a writable copy.
FROM golang:1.26-bookworm AS build
ARG SEAWEEDFS_VERSION=v0.0.0-20261109003541-7506e5f91cd6
RUN set -eux; \
    dir="$(go mod download -json "github.com/seaweedfs/seaweedfs@${SEAWEEDFS_VERSION}" \
      | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"; \
    cp -r "$dir" /src; \
    chmod -R u+w /src; \
    cd /src; \
    CGO_ENABLED=0 go build -buildvcs=false -o /weed ./weed

FROM alpine:3.20
COPY --from=build /weed /usr/local/bin/weed
# The identity (access key and secret) is written from the compose secrets at start; the S3
# API refuses anonymous requests.
ENTRYPOINT ["/bin/sh", "-c", "set -eu; printf '{\"identities\":[{\"name\":\"duality\",\"credentials\":[{\"accessKey\":\"%s\",\"secretKey\":\"%s\"}],\"actions\":[\"Admin\",\"Read\",\"List\",\"Tagging\",\"Write\"]}]}' \"$S3_ACCESS_KEY\" \"$(head -n 1 /run/secrets/s3_secret_key)\" > /tmp/s3.json; exec /usr/local/bin/weed \"$@\"", "weed"]
