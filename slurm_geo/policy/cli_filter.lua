--[[
slurm-geo: client-side defaults for jobs with --geo-ckpt-dir (cli_filter/lua).

Install next to slurm.conf with geo_policy.lua (`slurm-geo policy export-lua` writes
both); slurm.conf needs CliFilterPlugins=cli_filter/lua. For a job with --geo-ckpt-dir
that did not choose them itself, it adds
    --signal=B:USR1@<signal_lead_s of [policy]>   (the trainer's cue to checkpoint)
    --requeue
Slurm 22.05's job_submit/lua cannot set a job's warning signal, so this default is set
on the client; job_submit.lua sets --requeue again on the controller. Skipping it only
costs the job its own final checkpoint, never the site's policy.
]]

local DEFAULT_LEAD_S = 120

local function here()
  local source = debug.getinfo(1, "S").source
  return (string.match(source, "^@(.*)/[^/]*$")) or "."
end
local POLICY_FILE = here() .. "/geo_policy.lua"

local function has_ckpt_dir(options)
  local plugins = options.spank
  local ours = plugins and plugins["geo_directives"]
  return ours ~= nil and ours["geo-ckpt-dir"] ~= nil
end

local function signal_lead_s()
  local loaded, policy = pcall(dofile, POLICY_FILE)
  if loaded and type(policy) == "table" and policy.signal_lead_s then
    return policy.signal_lead_s
  end
  return DEFAULT_LEAD_S
end

function slurm_cli_setup_defaults(options, early_pass)
  return slurm.SUCCESS
end

function slurm_cli_pre_submit(options, offset)
  if not has_ckpt_dir(options) then return slurm.SUCCESS end
  -- Inside an allocation this is srun launching the job's ranks (it inherits the job's
  -- --geo-* options): its batch job got the defaults, and srun refuses a "B:" signal.
  if os.getenv("SLURM_JOB_ID") ~= nil then return slurm.SUCCESS end
  local signal = options["signal"]
  if signal == nil or signal == "" or signal == "0@0" then
    options["signal"] = "B:USR1@" .. signal_lead_s()
  end
  if options["requeue"] == "unset" then
    options["requeue"] = "1"
  end
  return slurm.SUCCESS
end

function slurm_cli_post_submit(offset, job_id, step_id)
  return slurm.SUCCESS
end
