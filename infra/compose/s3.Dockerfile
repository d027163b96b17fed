# kiln/stack-s3: versitygw (built from its Go module by infra/s3/s3.sh install) with its POSIX backend.
ARG BASE_IMAGE=kiln/base:latest
FROM ${BASE_IMAGE}
COPY versitygw /usr/local/bin/versitygw
RUN mkdir -p /data && chown 1000:1000 /data
USER 1000:1000
ENTRYPOINT ["/usr/local/bin/versitygw", "--port", ":7070"]
CMD ["posix", "/data"]
