#!/usr/bin/env bash
# Local stand-ins for the two images a machine without a registry cannot pull, built from
# Debian's archive alone (mmdebstrap) and imported with `docker import`, so the fleet can be
# built and run for real where pytorch/pytorch and postgres cannot be downloaded (CI):
#
#   hpo-test/base:TAG      Debian's Python 3.11 in a venv at /opt/venv, with the CPU torch the
#                          project pins, standing in for pytorch/pytorch (Python + torch + pip)
#   hpo-test/postgres:TAG  Debian's PostgreSQL with an entrypoint that honours the official
#                          image's contract: POSTGRES_USER, POSTGRES_PASSWORD, POSTGRES_DB,
#                          the data volume /var/lib/postgresql/data, pg_isready on the PATH
#
#   docker/standin-images.sh        builds what is missing, then prints HPO_BASE_IMAGE=... and
#                                   HPO_POSTGRES_IMAGE=... (the compose file's variables)
#
# Test images only: never tagged with the real images' names. TAG is a hash of this script and
# the torch version, so images already on the machine are reused until either changes.
# Needs root, mmdebstrap, a running Docker engine, and pip able to fetch torch==$TORCH (the CPU
# build: where pip would take a CUDA build, point it at the CPU wheels with PIP_FIND_LINKS or
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu).
set -euo pipefail

SUITE=bookworm
TORCH=2.13.0
PG_MAJOR=15  # bookworm's PostgreSQL
TAG=$( (cat "$0"; echo "$TORCH") | sha256sum | cut -c1-12)
BASE=hpo-test/base:$TAG
POSTGRES=hpo-test/postgres:$TAG
PATH_IN_IMAGE=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

have() { docker image inspect "$1" >/dev/null 2>&1; }

# In a session of its own: mmdebstrap's clean-up signals its process group, which would
# otherwise take this script (and whatever runs it) down with a SIGHUP.
debian_rootfs() { setsid --wait mmdebstrap --quiet --variant=minbase "$@"; }

# The host's extra certificate authorities (an HTTPS proxy's, say) go into the base too: the
# image build runs pip inside it, which must trust what the host trusts.
extra_cas() {
  mkdir -p "$work/cas"
  if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$work/cas/"
  fi
}

build_base() {
  pip download --quiet --dest "$work/wheels" "torch==$TORCH" >&2
  extra_cas
  debian_rootfs --include=python3,python3-venv,ca-certificates,passwd \
    --customize-hook="copy-in $work/cas /usr/local/share/ca-certificates" \
    --customize-hook='chroot "$1" update-ca-certificates >/dev/null' \
    --customize-hook="copy-in $work/wheels /tmp" \
    --customize-hook='chroot "$1" python3 -m venv /opt/venv' \
    --customize-hook="chroot \"\$1\" env -i /opt/venv/bin/pip install --quiet --no-index --find-links /tmp/wheels torch==$TORCH" \
    --customize-hook='rm -rf "$1"/tmp/wheels "$1"/root/.cache "$1"/var/lib/apt/lists/*' \
    "$SUITE" "$work/rootfs.tar"
  docker import \
    --change "ENV PATH=$PATH_IN_IMAGE" \
    --change "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt" \
    --change 'CMD ["python3"]' \
    "$work/rootfs.tar" "$BASE" >/dev/null
  rm "$work/rootfs.tar"
}

build_postgres() {
  cat > "$work/docker-entrypoint.sh" <<'ENTRYPOINT'
#!/bin/sh
# The official postgres image's contract, on Debian's PostgreSQL: a cluster initialised in
# $PGDATA on first start with the POSTGRES_USER superuser (password POSTGRES_PASSWORD, required)
# and the POSTGRES_DB database; password authentication from other hosts; the server as PID 1.
set -eu
: "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD is not set}"
user=${POSTGRES_USER:-postgres}
db=${POSTGRES_DB:-$user}
as_postgres() { setpriv --reuid=postgres --regid=postgres --init-groups "$@"; }
mkdir -p "$PGDATA" /run/postgresql
chown postgres:postgres "$PGDATA" /run/postgresql
chmod 700 "$PGDATA"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pwfile=$(mktemp)
  printf '%s' "$POSTGRES_PASSWORD" > "$pwfile"
  chown postgres "$pwfile"
  as_postgres initdb --pgdata="$PGDATA" --username="$user" --pwfile="$pwfile" \
    --auth-local=trust --auth-host=scram-sha-256 >/dev/null
  rm -f "$pwfile"
  echo "listen_addresses = '*'" >> "$PGDATA/postgresql.conf"
  echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
  if [ "$db" != postgres ]; then
    as_postgres pg_ctl --pgdata="$PGDATA" --options="-c listen_addresses=''" --wait \
      --silent start
    as_postgres psql --username="$user" --dbname=postgres --quiet \
      --command="CREATE DATABASE \"$db\""
    as_postgres pg_ctl --pgdata="$PGDATA" --wait --silent stop
  fi
fi
exec setpriv --reuid=postgres --regid=postgres --init-groups "$@"
ENTRYPOINT
  chmod 755 "$work/docker-entrypoint.sh"
  # The official image's STOPSIGNAL (SIGINT, a fast shutdown) cannot be set by `docker import`;
  # docker-compose.yml sets it for the service.
  # Debian's package creates a cluster of its own at install; the entrypoint makes the one used.
  debian_rootfs --include="postgresql-$PG_MAJOR" \
    --customize-hook="copy-in $work/docker-entrypoint.sh /usr/local/bin" \
    --customize-hook='rm -rf "$1"/var/lib/postgresql/'"$PG_MAJOR"' "$1"/etc/postgresql/'"$PG_MAJOR"' "$1"/var/lib/apt/lists/*' \
    "$SUITE" "$work/rootfs.tar"
  docker import \
    --change "ENV PATH=/usr/lib/postgresql/$PG_MAJOR/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
    --change "ENV PGDATA=/var/lib/postgresql/data" \
    --change 'VOLUME ["/var/lib/postgresql/data"]' \
    --change 'EXPOSE 5432' \
    --change 'ENTRYPOINT ["/usr/local/bin/docker-entrypoint.sh"]' \
    --change 'CMD ["postgres"]' \
    "$work/rootfs.tar" "$POSTGRES" >/dev/null
}

have "$BASE" || build_base
have "$POSTGRES" || build_postgres
echo "HPO_BASE_IMAGE=$BASE"
echo "HPO_POSTGRES_IMAGE=$POSTGRES"
