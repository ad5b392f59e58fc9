# Everything runs as root on Debian 12 (Slurm 22.05) or Debian 13 (Slurm 24.11).
PYTHON ?= python3
# mmdebstrap builds the rented provider's root filesystem (Debian sid, Slurm 26.05;
# slurm_geo/sandbox/rootfs.py) from Debian's registry, once per machine.
DEB_PACKAGES = slurm-wlm slurmdbd slurmrestd munge libslurm-dev mariadb-server restic lua5.1 python3-venv iproute2 util-linux etcd-server etcd-client prometheus mmdebstrap squashfs-tools
SLURM_GEO = $(PYTHON) -m slurm_geo
# Where bash-completion looks; without the package installed there is nothing to add to.
BASH_COMPLETIONS = /usr/share/bash-completion/completions
MAN_DIR = /usr/local/share/man/man1

.PHONY: install drill demo test test-quick lint check-cli man bench spank submit-as service-account

# The SPANK plugin of the --geo-* options, built against the installed Slurm headers.
SPANK_SO = build/spank/geo_directives.so
SPANK_SRC = slurm_geo/share/spank/geo_directives.c
SLURM_INCLUDE ?= /usr/include
SPANK_CFLAGS = -shared -fPIC -O2 -Wall -Wextra -Werror -std=gnu11

# prometheus is there for promtool (the tests check contrib/ with it): the server and the
# node exporter its install enables and starts are stopped and disabled again.
install:  ## Debian and Python packages (only what is missing), bash completion, man pages
	@missing=$$(for p in $(DEB_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "apt-get install $$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi && \
	if echo "$$missing" | grep -qx prometheus && [ -d /run/systemd/system ]; then \
		for unit in prometheus prometheus-node-exporter; do systemctl disable --now $$unit 2>/dev/null || true; done; \
	fi
	$(PYTHON) -m pip install -q --disable-pip-version-check -e '.[dev]' 'torch==2.13.0'
	@if [ -d $(BASH_COMPLETIONS) ]; then \
		$(SLURM_GEO) completion bash > $(BASH_COMPLETIONS)/slurm-geo; \
	fi
	@$(MAKE) --no-print-directory man
	install -d $(MAN_DIR) && install -m 0644 build/man/*.1 $(MAN_DIR)
	@$(MAKE) --no-print-directory spank
	@$(MAKE) --no-print-directory service-account
	@$(MAKE) --no-print-directory submit-as
	install -d -m 0755 $(LIBEXEC_DIR)
	install -o root -g $(SERVICE_ACCOUNT) -m 4750 $(SUBMIT_AS) $(LIBEXEC_DIR)/submit-as

# Written afresh, so a renamed command leaves no page behind.
man:  ## man pages from the help text, into build/man
	rm -rf build/man
	$(PYTHON) -m slurm_geo.cli.manpages build/man

spank: $(SPANK_SO)  ## the SPANK plugin (build/spank/geo_directives.so)

$(SPANK_SO): $(SPANK_SRC)
	@test -f $(SLURM_INCLUDE)/slurm/spank.h || { echo "spank: $(SLURM_INCLUDE)/slurm/spank.h is missing; install it with: apt-get install libslurm-dev" >&2; exit 1; }
	mkdir -p $(@D) && $(CC) $(SPANK_CFLAGS) -I$(SLURM_INCLUDE) -o $@ $<

# The daemons' own account (docs/install.md, "Which account each daemon runs as"): a system
# user and group, no login shell, no home of its own.
SERVICE_ACCOUNT = slurm-geo
service-account:  ## the daemons' unprivileged service account
	@getent group $(SERVICE_ACCOUNT) >/dev/null || groupadd --system $(SERVICE_ACCOUNT)
	@getent passwd $(SERVICE_ACCOUNT) >/dev/null || useradd --system --gid $(SERVICE_ACCOUNT) \
		--home-dir /var/lib/slurm-geo --no-create-home --shell /usr/sbin/nologin $(SERVICE_ACCOUNT)

# The one privileged program: starts a job as its owner (slurm_geo/share/libexec/submit_as.c).
# Installed setuid root, runnable by the service account's group only.
SUBMIT_AS = build/libexec/submit-as
LIBEXEC_DIR = /usr/local/libexec/slurm-geo
SUBMIT_AS_CFLAGS = -O2 -Wall -Wextra -Werror -std=gnu11 -D_FORTIFY_SOURCE=2 -fstack-protector-strong -fPIE -pie -Wl,-z,relro,-z,now
submit-as: $(SUBMIT_AS)  ## the setuid helper that submits a job as its owner

$(SUBMIT_AS): slurm_geo/share/libexec/submit_as.c
	mkdir -p $(@D) && $(CC) $(SUBMIT_AS_CFLAGS) -DSBATCH_PATH='"$(shell command -v sbatch || echo /usr/bin/sbatch)"' \
		-DSERVICE_GROUP='"$(SERVICE_ACCOUNT)"' -o $@ $<

drill: install  ## the failover drill: lose onprem, continue on rented, report
	$(SLURM_GEO) sandbox up
	$(SLURM_GEO) drill

demo: install  ## bring the sandbox up and run a job on each cluster
	$(SLURM_GEO) sandbox up
	$(SLURM_GEO) sandbox demo

lint:
	ruff check .
	mypy slurm_geo

# The CI step of docs/cli.md's conventions: --help everywhere, --json on every command that
# reports state, the docs' exit-code table equal to slurm_geo.exitcodes. Seconds, no sandbox.
check-cli:  ## the CLI conventions of docs/cli.md
	$(PYTHON) -m pytest -q -p no:cacheprovider tests/test_cli_conventions.py tests/test_exitcodes.py \
		tests/test_cli_error_classes.py

test: install lint check-cli  ## the whole suite, against the real sandbox; the slowest 30 listed
	$(PYTHON) -m pytest -q --durations=30

test-quick: lint  ## skips tests marked slow
	$(PYTHON) -m pytest -q -m "not slow"

bench: install
	$(PYTHON) bench/cli_startup.py
	$(PYTHON) bench/sandbox_up.py
	$(PYTHON) bench/prolog_fastpath.py
	$(PYTHON) bench/cli_vs_restic.py
