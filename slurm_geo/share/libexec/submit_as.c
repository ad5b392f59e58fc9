/*
 * slurm-geo-submit-as: the one thing slurm-geo does as root.
 *
 * The federation daemon runs as an unprivileged service account. To start a job as its
 * owner on a cluster it reaches by Slurm's CLI, it runs this helper (installed setuid
 * root, mode 4750, group slurm-geo: only the service account may run it) with a request
 * on standard input. The helper takes nothing from its caller but that request: its
 * environment is cleared before anything else, it reads no file and follows no path
 * that anyone else names, and it drops to the owner's uid, gid and groups BEFORE sbatch,
 * the owner's script, the owner's environment or anything else the owner controls is
 * read or executed. sbatch then runs as the owner, with the owner's rights: an
 * `#SBATCH --export-file=` or `--output=` in the script opens files as the owner, a
 * PYTHONPATH or LD_LIBRARY_PATH in the job's environment loads code into the owner's
 * own process, never into root's. Slurm's `sbatch --uid` (root only, deprecated in
 * 26.05) is not needed and is refused.
 *
 * The request (NUL-terminated fields, then the script up to end of input):
 *
 *     slurm-geo-submit-as/1
 *     USER            the owner's login name
 *     UID GID         decimal; the passwd entry of USER must have this uid, and the gid
 *                     must be USER's primary group or one of their groups
 *     SLURM_CONF      absolute path of the cluster's slurm.conf
 *     NARGS           decimal, then NARGS sbatch options, each from a fixed list
 *     NENV            decimal, then NENV NAME=VALUE entries: the job's whole environment
 *     SCRIPT          the batch script: every byte after the last field
 *
 * Exit: sbatch's own status once it runs; else 64 (a malformed request), 77 (refused:
 * caller, owner or option not allowed), 71 (a system call failed). One line on stderr.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <grp.h>
#include <limits.h>
#include <pwd.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/types.h>
#include <unistd.h>

#ifndef SBATCH_PATH
#define SBATCH_PATH "/usr/bin/sbatch"
#endif
#ifndef SERVICE_GROUP
#define SERVICE_GROUP "slurm-geo"
#endif
#ifndef MIN_UID
#define MIN_UID 1000
#endif

#define MAGIC "slurm-geo-submit-as/1"
#define REQUEST_MAX (8u << 20)  /* 8 MiB: Slurm's own batch script limit is 4 MB */
#define ARGS_MAX 32
#define ENV_MAX 4096

#define EXIT_MALFORMED 64
#define EXIT_REFUSED 77
#define EXIT_SYSTEM 71

/* The sbatch options a request may carry: exactly what the daemon's JobSpec renders. */
static const char *const ALLOWED_PREFIXES[] = {
	"--job-name=", "--chdir=", "--nodes=", "--cpus-per-task=", "--ntasks-per-node=",
	"--partition=", "--time=", "--signal=", "--output=", "--comment=", NULL,
};
static const char *const ALLOWED_FLAGS[] = {
	"--parsable", "--test-only", "--export=ALL", "--requeue", "--no-requeue", "--hold",
	NULL,
};

static void die(int code, const char *fmt, ...)
{
	va_list ap;

	fputs("slurm-geo-submit-as: ", stderr);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	exit(code);
}

struct request {
	char *buf;
	size_t len, pos;
};

static void read_request(struct request *r)
{
	size_t cap = 65536;

	r->buf = malloc(cap);
	r->len = r->pos = 0;
	if (!r->buf)
		die(EXIT_SYSTEM, "out of memory");
	for (;;) {
		ssize_t n;

		if (r->len == cap) {
			if (cap >= REQUEST_MAX)
				die(EXIT_MALFORMED, "request larger than %u bytes", REQUEST_MAX);
			cap *= 2;
			r->buf = realloc(r->buf, cap);
			if (!r->buf)
				die(EXIT_SYSTEM, "out of memory");
		}
		n = read(STDIN_FILENO, r->buf + r->len, cap - r->len);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			die(EXIT_SYSTEM, "reading the request: %s", strerror(errno));
		if (n == 0)
			break;
		r->len += (size_t) n;
	}
}

/* The next NUL-terminated field. */
static char *field(struct request *r, const char *what)
{
	char *start = r->buf + r->pos;
	char *end = memchr(start, '\0', r->len - r->pos);

	if (!end)
		die(EXIT_MALFORMED, "the request ends before its %s", what);
	r->pos = (size_t) (end - r->buf) + 1;
	return start;
}

static unsigned long number(struct request *r, const char *what, unsigned long most)
{
	char *text = field(r, what), *end;
	unsigned long value;

	errno = 0;
	value = strtoul(text, &end, 10);
	if (!*text || *end || errno || value > most || text[0] == '-' || text[0] == '+')
		die(EXIT_MALFORMED, "%s is not a number up to %lu", what, most);
	return value;
}

static int starts_with_any(const char *arg, const char *const *prefixes)
{
	for (int i = 0; prefixes[i]; i++)
		if (!strncmp(arg, prefixes[i], strlen(prefixes[i])))
			return 1;
	return 0;
}

static int equals_any(const char *arg, const char *const *words)
{
	for (int i = 0; words[i]; i++)
		if (!strcmp(arg, words[i]))
			return 1;
	return 0;
}

static int caller_in_service_group(void)
{
	struct group *service = getgrnam(SERVICE_GROUP);
	gid_t groups[NGROUPS_MAX];
	int count;

	if (!service)
		return 0;
	if (getgid() == service->gr_gid)
		return 1;
	count = getgroups(NGROUPS_MAX, groups);
	for (int i = 0; i < count; i++)
		if (groups[i] == service->gr_gid)
			return 1;
	return 0;
}

static int user_in_group(const struct passwd *pw, gid_t gid)
{
	gid_t groups[NGROUPS_MAX];
	int count = NGROUPS_MAX;

	if (pw->pw_gid == gid)
		return 1;
	if (getgrouplist(pw->pw_name, pw->pw_gid, groups, &count) < 0)
		return 0;
	for (int i = 0; i < count; i++)
		if (groups[i] == gid)
			return 1;
	return 0;
}

static int valid_env_name(const char *entry)
{
	const char *eq = strchr(entry, '=');

	if (!eq || eq == entry)
		return 0;
	for (const char *c = entry; c < eq; c++)
		if (*c < 0x21 || *c > 0x7e)
			return 0;
	return 1;
}

static void drop_to(const struct passwd *pw, gid_t gid)
{
	if (initgroups(pw->pw_name, gid) < 0 || setgid(gid) < 0 || setuid(pw->pw_uid) < 0)
		die(EXIT_SYSTEM, "cannot become %s: %s", pw->pw_name, strerror(errno));
	/* Never back: a uid that could regain root is a bug here, not a job. */
	if (setuid(0) == 0 || geteuid() != pw->pw_uid || getegid() != gid || getuid() != pw->pw_uid)
		die(EXIT_SYSTEM, "still privileged after dropping to %s; refusing", pw->pw_name);
}

static void close_other_fds(void)
{
	long most = sysconf(_SC_OPEN_MAX);

	if (most < 0 || most > 65536)
		most = 65536;
	for (int fd = 3; fd < most; fd++)
		close(fd);
}

int main(int argc, char **argv)
{
	struct request r;
	struct passwd *pw;
	char *user, *slurm_conf, *args[ARGS_MAX + 2], **envp;
	unsigned long uid, gid, nargs, nenv;
	int script_fd;

	(void) argv;
	/* Nothing of the caller's environment is read, ever. */
	clearenv();
	close_other_fds();
	if (argc != 1)
		die(EXIT_MALFORMED, "takes no arguments: the request comes on standard input");
	if (getuid() != 0 && !caller_in_service_group())
		die(EXIT_REFUSED, "only root and the %s group may submit as another user",
		    SERVICE_GROUP);
	read_request(&r);
	if (strcmp(field(&r, "version"), MAGIC))
		die(EXIT_MALFORMED, "not a %s request", MAGIC);
	user = field(&r, "user");
	uid = number(&r, "uid", UINT_MAX - 1);
	gid = number(&r, "gid", UINT_MAX - 1);
	slurm_conf = field(&r, "slurm.conf path");
	nargs = number(&r, "option count", ARGS_MAX);

	pw = getpwnam(user);
	if (!pw || pw->pw_uid != (uid_t) uid)
		die(EXIT_REFUSED, "user %s does not have uid %lu here", user, uid);
	if (uid == 0 || uid < MIN_UID)
		die(EXIT_REFUSED, "will not submit as %s (uid %lu): jobs run as users with uid >= %d",
		    user, uid, MIN_UID);
	if (!user_in_group(pw, (gid_t) gid))
		die(EXIT_REFUSED, "%s is not in group %lu", user, gid);
	if (slurm_conf[0] != '/' || strstr(slurm_conf, "/../") || strlen(slurm_conf) > PATH_MAX)
		die(EXIT_MALFORMED, "slurm.conf path %s is not absolute", slurm_conf);

	args[0] = SBATCH_PATH;
	for (unsigned long i = 0; i < nargs; i++) {
		char *arg = field(&r, "sbatch option");

		if (!starts_with_any(arg, ALLOWED_PREFIXES) && !equals_any(arg, ALLOWED_FLAGS))
			die(EXIT_REFUSED, "sbatch option %.40s is not one a resubmission carries", arg);
		if (strchr(arg, '\n'))
			die(EXIT_REFUSED, "sbatch option %.40s holds a newline", arg);
		args[i + 1] = arg;
	}
	args[nargs + 1] = NULL;

	nenv = number(&r, "environment count", ENV_MAX);
	envp = calloc(nenv + 2, sizeof(*envp));
	if (!envp)
		die(EXIT_SYSTEM, "out of memory");
	for (unsigned long i = 0; i < nenv; i++) {
		char *entry = field(&r, "environment entry");

		if (!valid_env_name(entry) || !strncmp(entry, "SLURM_CONF=", 11))
			die(EXIT_MALFORMED, "environment entry %.40s is not NAME=VALUE", entry);
		envp[i] = entry;
	}
	if (asprintf(&envp[nenv], "SLURM_CONF=%s", slurm_conf) < 0)
		die(EXIT_SYSTEM, "out of memory");
	envp[nenv + 1] = NULL;

	/* From here on we are the owner: nothing below can read what they could not. */
	drop_to(pw, (gid_t) gid);
	if (chdir("/") < 0)
		die(EXIT_SYSTEM, "chdir /: %s", strerror(errno));

	script_fd = memfd_create("batch-script", 0);
	if (script_fd < 0)
		die(EXIT_SYSTEM, "memfd_create: %s", strerror(errno));
	for (size_t done = r.pos; done < r.len;) {
		ssize_t n = write(script_fd, r.buf + done, r.len - done);

		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			die(EXIT_SYSTEM, "writing the script: %s", strerror(errno));
		done += (size_t) n;
	}
	if (lseek(script_fd, 0, SEEK_SET) < 0 || dup2(script_fd, STDIN_FILENO) < 0)
		die(EXIT_SYSTEM, "handing the script to sbatch: %s", strerror(errno));
	close(script_fd);
	execve(SBATCH_PATH, args, envp);
	die(EXIT_SYSTEM, "cannot run %s: %s", SBATCH_PATH, strerror(errno));
	return EXIT_SYSTEM;
}
