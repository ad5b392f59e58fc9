/*
 * A harness for slurm_geo/share/spank/geo_directives.c without Slurm: the plugin's source is included
 * here, the few Slurm calls it makes are stubbed, and main() drives it as sbatch would.
 *
 *   spank_harness options            the options it registers: "NAME\tARG_INFO" lines
 *   spank_harness unknown WORD...    per WORD "1" when it is an unknown --geo-* option
 *   spank_harness hand NAME=VALUE... register, receive the options as sbatch gives them,
 *                                    and print the validator's argv and what Slurm's
 *                                    hooks get ("GEO_NAME=VALUE"), one a line
 *
 * Built by tests/test_world.py with the Makefile's flags.
 */
#include <stdarg.h>

#include "../slurm_geo/share/spank/geo_directives.c"

static struct spank_option registered[GEO_OPTION_COUNT];
static int registered_count;
static spank_context_t harness_context = S_CTX_ALLOCATOR;

spank_context_t spank_context(void) { return harness_context; }

spank_err_t spank_option_register(spank_t sp, struct spank_option *opt)
{
	(void) sp;
	registered[registered_count++] = *opt;
	return ESPANK_SUCCESS;
}

spank_err_t spank_job_control_setenv(spank_t sp, const char *name, const char *value,
				     int overwrite)
{
	(void) sp;
	(void) overwrite;
	printf("control %s=%s\n", name, value);
	return ESPANK_SUCCESS;
}

spank_err_t spank_setenv(spank_t sp, const char *var, const char *val, int overwrite)
{
	(void) sp;
	(void) overwrite;
	printf("job %s=%s\n", var, val);
	return ESPANK_SUCCESS;
}

const char *spank_strerror(spank_err_t err) { (void) err; return "error"; }

void slurm_error(const char *format, ...)
{
	va_list args;

	va_start(args, format);
	vfprintf(stderr, format, args);
	va_end(args);
	fputc('\n', stderr);
}

int main(int argc, char **argv)
{
	if (argc < 2)
		return 2;
	setenv("SLURM_JOB_ID", "1", 1);  /* no typo scan of the harness's own command line */
	if (slurm_spank_init(NULL, 0, NULL) != 0)
		return 1;
	if (!strcmp(argv[1], "options")) {
		for (int i = 0; i < registered_count; i++)
			printf("%s\t%s\n", registered[i].name, registered[i].arginfo);
		return 0;
	}
	if (!strcmp(argv[1], "unknown")) {
		for (int i = 2; i < argc; i++)
			printf("%d\n", unknown_geo_option(argv[i]));
		return 0;
	}
	if (!strcmp(argv[1], "hand")) {
		char **args;

		for (int i = 2; i < argc; i++) {
			size_t length = strcspn(argv[i], "=");
			int found = 0;

			for (int j = 0; j < registered_count; j++)
				if (strlen(registered[j].name) == length &&
				    !strncmp(registered[j].name, argv[i], length)) {
					registered[j].cb(registered[j].val, argv[i] + length + 1, 0);
					found = 1;
				}
			if (!found)
				return 3;
		}
		validator = "/bin/validator";
		args = validator_argv();
		for (int i = 0; args && args[i]; i++)
			printf("argv %s\n", args[i]);
		free_argv(args);
		if (hand_to_job_control(NULL) != 0)
			return 1;
		harness_context = S_CTX_REMOTE;
		return hand_to_job_environment(NULL);
	}
	return 2;
}
