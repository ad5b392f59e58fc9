/*
 * geo_directives: the `--geo-*` sbatch/salloc/srun options of slurm-geo (SPANK plugin).
 *
 * It parses and hands over; every rule lives in Python (slurm_geo.policy):
 *
 *   allocator/local context (sbatch, salloc, srun on a login node), at load:
 *     0. a --geo-NAME on the command line or in sbatch's #SBATCH block that is no
 *        directive: the validator names the closest one, and the command exits 1
 *        (Slurm would only say "unrecognized option");
 *   after all options:
 *     1. if any --geo-* option was given and plugstack.conf names a validator, run it as
 *        `VALIDATOR [--config=PATH] [--cluster=NAME] --geo-NAME=VALUE ...` (no shell) and,
 *        when it exits non-zero, print its one-line message and exit 1: nothing is queued;
 *     2. spank_job_control_setenv("GEO_<NAME>", value): Prolog, Epilog, PrologSlurmctld
 *        and EpilogSlurmctld see SPANK_GEO_<NAME>; job_submit.lua sees GEO_<NAME> in
 *        job_desc.spank_job_env.
 *   remote context (slurmstepd, every step including the batch step):
 *     3. spank_setenv("SLURM_GEO_<NAME>", value): the job's own environment.
 *
 * plugstack.conf:
 *   required /usr/local/lib/slurm-geo/geo_directives.so \
 *            validator=/usr/local/libexec/slurm-geo/check_directives.py \
 *            config=/etc/slurm-geo/config.toml cluster=onprem
 */

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <slurm/spank.h>

SPANK_PLUGIN(geo_directives, 1);

#define GEO_OPTION_COUNT 11
#define MESSAGE_MAX 1024
#define VALIDATOR_TIMEOUT_MS 30000

/* Option name, the NAME in GEO_NAME / SLURM_GEO_NAME, the help text. */
static const char *const option_names[GEO_OPTION_COUNT] = {
	"geo-ckpt-dir", "geo-ckpt-interval", "geo-residency", "geo-data-class",
	"geo-cost-center", "geo-max-cost", "geo-failover", "geo-clusters",
	"geo-inputs", "geo-env", "geo-outputs",
};
static const char *const env_names[GEO_OPTION_COUNT] = {
	"CKPT_DIR", "CKPT_INTERVAL", "RESIDENCY", "DATA_CLASS",
	"COST_CENTER", "MAX_COST", "FAILOVER", "CLUSTERS",
	"INPUTS", "ENV", "OUTPUTS",
};
static const char *const arg_info[GEO_OPTION_COUNT] = {
	"path", "minutes", "region[,region...]", "public|internal|restricted",
	"name", "usd", "auto|manual|never", "cluster[,cluster...]",
	"path[:class][,path[:class]...]", "path", "path[,path...]",
};
static const char *const usage[GEO_OPTION_COUNT] = {
	"slurm-geo: checkpoint directory of this job (enables requeue on time limit)",
	"slurm-geo: minutes between checkpoints",
	"slurm-geo: regions the job's data and checkpoints may go to",
	"slurm-geo: data class of the job's data",
	"slurm-geo: cost center charged for the job",
	"slurm-geo: most the job may cost, in USD",
	"slurm-geo: what to do when the cluster is lost",
	"slurm-geo: clusters the job may run on",
	"slurm-geo: what the job reads (datasets, code), read-only where it moves",
	"slurm-geo: the job's virtualenv/conda directory or container image",
	"slurm-geo: what the job writes, brought home",
};

static char *values[GEO_OPTION_COUNT];
static const char *validator;

#define ROOT_VALIDATOR_PATH "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
static const char *config_path;
static const char *cluster_name;

static int remember(int index, const char *optarg, int remote)
{
	(void) remote;
	if (index < 0 || index >= GEO_OPTION_COUNT)
		return -1;
	free(values[index]);
	values[index] = strdup(optarg ? optarg : "");
	return values[index] ? 0 : -1;
}

static int any_given(void)
{
	for (int i = 0; i < GEO_OPTION_COUNT; i++)
		if (values[i])
			return 1;
	return 0;
}

static void read_arguments(int ac, char **av)
{
	for (int i = 0; i < ac; i++) {
		if (!strncmp(av[i], "validator=", 10))
			validator = av[i] + 10;
		else if (!strncmp(av[i], "config=", 7))
			config_path = av[i] + 7;
		else if (!strncmp(av[i], "cluster=", 8))
			cluster_name = av[i] + 8;
		else
			slurm_error("geo_directives: unknown plugstack.conf argument '%s'", av[i]);
	}
}

static void suggest_for_typos(void);

int slurm_spank_init(spank_t sp, int ac, char **av)
{
	spank_context_t context = spank_context();

	read_arguments(ac, av);
	if (context != S_CTX_ALLOCATOR && context != S_CTX_LOCAL && context != S_CTX_REMOTE)
		return 0;
	if ((context == S_CTX_ALLOCATOR || context == S_CTX_LOCAL) && !getenv("SLURM_JOB_ID"))
		suggest_for_typos();
	for (int i = 0; i < GEO_OPTION_COUNT; i++) {
		struct spank_option option = {
			(char *) option_names[i], (char *) arg_info[i], (char *) usage[i],
			1, i, remember,
		};
		if (spank_option_register(sp, &option) != ESPANK_SUCCESS) {
			slurm_error("geo_directives: cannot register --%s", option_names[i]);
			return -1;
		}
	}
	return 0;
}

static char *with_prefix(const char *prefix, const char *name, const char *value)
{
	size_t size = strlen(prefix) + strlen(name) + (value ? strlen(value) : 0) + 3;
	char *text = malloc(size);

	if (!text)
		return NULL;
	if (value)
		snprintf(text, size, "%s%s=%s", prefix, name, value);
	else
		snprintf(text, size, "%s%s", prefix, name);
	return text;
}

/* argv for the validator; every element malloc'ed, NULL-terminated. */
static char **validator_argv(void)
{
	char **argv = calloc(GEO_OPTION_COUNT + 4, sizeof(char *));
	int n = 0;

	if (!argv)
		return NULL;
	argv[n++] = strdup(validator);
	if (config_path)
		argv[n++] = with_prefix("--", "config", config_path);
	if (cluster_name)
		argv[n++] = with_prefix("--", "cluster", cluster_name);
	for (int i = 0; i < GEO_OPTION_COUNT; i++)
		if (values[i])
			argv[n++] = with_prefix("--", option_names[i], values[i]);
	for (int i = 0; i < n; i++)
		if (!argv[i])
			return NULL;
	return argv;
}

static void free_argv(char **argv)
{
	if (!argv)
		return;
	for (int i = 0; argv[i]; i++)
		free(argv[i]);
	free(argv);
}

/* Read the child's output until EOF or the buffer is full; -1 if the timeout passed. */
static int read_message(int fd, char *message, size_t size)
{
	size_t used = 0;
	struct pollfd pfd = { fd, POLLIN, 0 };
	int timed_out = 0;

	message[0] = '\0';
	while (used + 1 < size) {
		int ready = poll(&pfd, 1, VALIDATOR_TIMEOUT_MS);
		ssize_t got;

		if (ready < 0 && errno == EINTR)
			continue;
		if (ready <= 0) {
			timed_out = ready == 0;
			break;
		}
		got = read(fd, message + used, size - 1 - used);
		if (got < 0 && errno == EINTR)
			continue;
		if (got <= 0)
			break;
		used += (size_t) got;
	}
	message[used] = '\0';
	message[strcspn(message, "\n")] = '\0';  /* one line */
	return timed_out ? -1 : 0;
}

/* The child's exit status (128 + signal when killed). */
static int wait_for(pid_t pid)
{
	int status;

	while (waitpid(pid, &status, 0) < 0)
		if (errno != EINTR)
			return -1;
	return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* 0 when the validator accepts `argv` (freed here); prints its message and returns -1 if
 * not. */
static int run_validator(char **argv)
{
	char message[MESSAGE_MAX];
	int pipe_fds[2], code;
	pid_t pid;

	if (!argv || pipe(pipe_fds) < 0) {
		free_argv(argv);
		slurm_error("geo: cannot check the --geo-* options: %s", strerror(errno));
		return -1;
	}
	pid = fork();
	if (pid < 0) {
		slurm_error("geo: cannot check the --geo-* options: %s", strerror(errno));
		close(pipe_fds[0]);
		close(pipe_fds[1]);
		free_argv(argv);
		return -1;
	}
	if (pid == 0) {
		dup2(pipe_fds[1], STDOUT_FILENO);
		dup2(pipe_fds[1], STDERR_FILENO);
		close(pipe_fds[0]);
		close(pipe_fds[1]);
		/*
		 * As root (a site's own sbatch as root, or a setuid wrapper), the validator
		 * gets a fixed environment: a user's PYTHONPATH, LD_* or BASH_ENV never reaches
		 * a privileged interpreter. As anyone else it runs with their own.
		 */
		if (getuid() == 0 || geteuid() == 0 || getuid() != geteuid())
			execve(argv[0], argv, (char *[]) { ROOT_VALIDATOR_PATH, NULL });
		else
			execv(argv[0], argv);
		fprintf(stderr, "geo: cannot run the directive validator %s: %s; ask your admin",
			argv[0], strerror(errno));
		_exit(127);
	}
	close(pipe_fds[1]);
	free_argv(argv);
	if (read_message(pipe_fds[0], message, sizeof(message)) < 0) {
		kill(pid, SIGKILL);
		snprintf(message, sizeof(message),
			 "geo: the directive validator %s did not answer within %d s; ask your admin",
			 validator, VALIDATOR_TIMEOUT_MS / 1000);
	}
	close(pipe_fds[0]);
	code = wait_for(pid);
	if (code == 0)
		return 0;
	slurm_error("%s", message[0] ? message : "geo: the --geo-* options were rejected");
	return -1;
}

static int validate(void)
{
	return run_validator(validator_argv());
}

/*
 * A mistyped --geo-* option: Slurm refuses it ("unrecognized option") before any plugin
 * sees it, so at load, in sbatch/salloc/srun, the plugin reads what the user typed (its
 * command line and, for sbatch, the script's #SBATCH block) and, for a --geo-NAME that is
 * no directive (nor the start of one, which getopt accepts), has the validator name the
 * closest directive and stops: "geo: unknown option --geo-failovr; did you mean
 * --geo-failover?". Only as the user (never root, never set-uid): nothing a user controls
 * is read with privileges. A suggestion only: what it cannot read, Slurm still refuses.
 */
#define SCRIPT_MAX 65536

/* 1 when `word` ("--geo-NAME[=VALUE]") names no directive nor the start of one. */
static int unknown_geo_option(const char *word)
{
	size_t length;

	if (strncmp(word, "--geo-", 6))
		return 0;
	length = strcspn(word + 2, "=");
	for (int i = 0; i < GEO_OPTION_COUNT; i++)
		if (length <= strlen(option_names[i]) && !strncmp(word + 2, option_names[i], length))
			return 0;
	return 1;
}

/* Hand the first unknown option to the validator (it says what was meant); exits 1. */
static void refuse_unknown(const char *word)
{
	char **argv;

	if (!validator) {
		slurm_error("geo: unknown option %.*s", (int) strcspn(word, "="), word);
		return;  /* Slurm refuses it next */
	}
	argv = calloc(3, sizeof(char *));  /* run_validator frees it */
	if (!argv)
		return;
	argv[0] = strdup(validator);
	argv[1] = strchr(word, '=') ? strdup(word) : with_prefix("", word, "");
	if (!argv[0] || !argv[1]) {
		free(argv[1]);
		free_argv(argv);
		return;
	}
	if (run_validator(argv) < 0)
		exit(1);
}

/*
 * -1 when `path` is no script (not a regular file starting with "#!"); else 1 when its
 * #SBATCH block has an unknown --geo-* word (copied to `found`), 0 when not.
 */
static int scan_script(const char *path, char *found, size_t size)
{
	char *text, *line, *next;
	struct stat st;
	ssize_t got = -1;
	int fd, hit = 0;

	fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
	if (fd < 0)
		return -1;
	text = malloc(SCRIPT_MAX + 1);
	if (text && fstat(fd, &st) == 0 && S_ISREG(st.st_mode))
		got = read(fd, text, SCRIPT_MAX);
	close(fd);
	if (!text || got < 2 || strncmp(text, "#!", 2)) {
		free(text);
		return -1;
	}
	text[got] = '\0';
	for (line = text; line && !hit; line = next) {
		next = strchr(line, '\n');
		if (next)
			*next++ = '\0';
		if (line[strspn(line, " \t\r")] == '\0' ||
		    (line[0] == '#' && strncmp(line, "#SBATCH", 7)))
			continue;
		if (strncmp(line, "#SBATCH", 7))
			break;  /* sbatch stops reading options at the first command */
		for (char *word = strtok(line + 7, " \t\r"); word; word = strtok(NULL, " \t\r"))
			if (unknown_geo_option(word)) {
				snprintf(found, size, "%s", word);
				hit = 1;
				break;
			}
	}
	free(text);
	return hit;
}

static void suggest_for_typos(void)
{
	char *args = malloc(SCRIPT_MAX + 1), found[MESSAGE_MAX];
	const char *program;
	ssize_t got = -1;
	int fd;

	if (getuid() == 0 || geteuid() == 0 || getuid() != geteuid() || !args)
		goto done;
	fd = open("/proc/self/cmdline", O_RDONLY | O_CLOEXEC);
	if (fd >= 0) {
		got = read(fd, args, SCRIPT_MAX);
		close(fd);
	}
	if (got <= 0)
		goto done;
	args[got] = '\0';
	program = strrchr(args, '/') ? strrchr(args, '/') + 1 : args;
	for (char *arg = args + strlen(args) + 1; arg < args + got; arg += strlen(arg) + 1) {
		if (!strcmp(arg, "--"))
			break;
		if (unknown_geo_option(arg)) {
			refuse_unknown(arg);
			break;
		}
		if (arg[0] == '-')
			continue;
		/*
		 * A word that is no option: sbatch's script (what follows is the script's own
		 * arguments), else an option's value ("-p gpu"); for salloc and srun, the
		 * command, or a value: either way the scan stops, never reading a command's
		 * arguments as ours.
		 */
		if (strcmp(program, "sbatch"))
			break;
		switch (scan_script(arg, found, sizeof(found))) {
		case 1:
			refuse_unknown(found);
			goto done;
		case 0:
			goto done;
		default:
			continue;
		}
	}
done:
	free(args);
}

static int hand_to_job_control(spank_t sp)
{
	for (int i = 0; i < GEO_OPTION_COUNT; i++) {
		char *name;
		spank_err_t rc;

		if (!values[i])
			continue;
		name = with_prefix("GEO_", env_names[i], NULL);
		rc = name ? spank_job_control_setenv(sp, name, values[i], 1) : ESPANK_ERROR;
		free(name);
		if (rc != ESPANK_SUCCESS) {
			slurm_error("geo: cannot pass --%s to Slurm: %s", option_names[i],
				    spank_strerror(rc));
			return -1;
		}
	}
	return 0;
}

static int hand_to_job_environment(spank_t sp)
{
	for (int i = 0; i < GEO_OPTION_COUNT; i++) {
		char *name;

		if (!values[i])
			continue;
		name = with_prefix("SLURM_GEO_", env_names[i], NULL);
		if (!name || spank_setenv(sp, name, values[i], 1) != ESPANK_SUCCESS)
			slurm_error("geo: cannot set SLURM_GEO_%s in the job", env_names[i]);
		free(name);
	}
	return 0;
}

int slurm_spank_init_post_opt(spank_t sp, int ac, char **av)
{
	spank_context_t context = spank_context();

	(void) ac;
	(void) av;
	if (!any_given())
		return 0;
	if (context == S_CTX_LOCAL && getenv("SLURM_JOB_ID"))
		return 0;  /* srun inside a job: the job's directives are already in place */
	if (context == S_CTX_ALLOCATOR || context == S_CTX_LOCAL) {
		/*
		 * Nothing is queued yet. Exit here rather than return -1, after which sbatch
		 * would add two generic lines about the plugin stack to our one clear line.
		 */
		if (validator && validate() < 0)
			exit(1);
		return hand_to_job_control(sp);
	}
	if (context == S_CTX_REMOTE)
		return hand_to_job_environment(sp);
	return 0;
}

int slurm_spank_exit(spank_t sp, int ac, char **av)
{
	(void) sp;
	(void) ac;
	(void) av;
	for (int i = 0; i < GEO_OPTION_COUNT; i++) {
		free(values[i]);
		values[i] = NULL;
	}
	return 0;
}
