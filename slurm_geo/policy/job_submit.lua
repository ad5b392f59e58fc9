--[[
slurm-geo: controller-side check of the --geo-* directives (job_submit/lua).

Install next to slurm.conf, with the policy data it reads at every submission:
    slurm-geo policy export-lua --cluster NAME --dir /etc/slurm
writes geo_policy.lua (the [policy] table of the slurm-geo config, and every cluster's
region) and this file; slurm.conf needs JobSubmitPlugins=lua.

A client can skip the SPANK plugin's check (another slurm.conf, another plugin, or
slurmrestd, which never runs SPANK), so the rules that matter are enforced here again,
with the same messages as slurm_geo/policy/geo.py, in the same order:
  - directives from job_desc.spank_job_env (GEO_<NAME>, set by the SPANK plugin), else,
    for batch jobs, from the job's environment (SLURM_GEO_<NAME>: REST submissions);
  - a batch job whose environment carries a SLURM_SPANK_GEO_<NAME> the SPANK plugin did
    not hand over (the user's own export, a client skipping the plugin): rejected, since
    the federation daemon reads a pending job's directives there;
  - malformed values (an option without a value, a checkpoint path with '..' or past
    PATH_MAX, a --geo-inputs/--geo-env/--geo-outputs path likewise, or a list too long),
    an output overlapping an input or the env (syntax only: the paths of a job's world
    are never looked up here, as root), unknown regions and clusters, --geo-clusters leaving out this cluster,
    failover=auto without a checkpoint directory, failover=auto where the residency and
    --geo-clusters leave no other cluster, a missing cost center where required:
    rejected (slurm.ERROR);
  - residency outside the data class's regions or excluding this cluster, an input whose
    own data class may not reside in this cluster's region, clusters
    outside the residency, unknown cost centers, budgets exceeded: rejected
    (slurm.ESLURM_ACCESS_DENIED);
  - a job with a checkpoint directory gets --requeue unless it said --no-requeue;
  - an accepted job's cost center goes into its admin comment, for billing.
Jobs without directives pass untouched. To add this to a site's own job_submit.lua, call
geo_job_submit(job_desc, submit_uid) from its slurm_job_submit and return on non-SUCCESS.
]]

local NO_VAL16 = 65534
local SPECS = {
  { option = "geo-ckpt-dir", env = "CKPT_DIR" },
  { option = "geo-ckpt-interval", env = "CKPT_INTERVAL" },
  { option = "geo-residency", env = "RESIDENCY" },
  { option = "geo-data-class", env = "DATA_CLASS" },
  { option = "geo-cost-center", env = "COST_CENTER" },
  { option = "geo-max-cost", env = "MAX_COST" },
  { option = "geo-failover", env = "FAILOVER" },
  { option = "geo-clusters", env = "CLUSTERS" },
  { option = "geo-inputs", env = "INPUTS" },
  { option = "geo-env", env = "ENV" },
  { option = "geo-outputs", env = "OUTPUTS" },
}
local DATA_CLASSES = { "public", "internal", "restricted" }
local FAILOVER_MODES = { "auto", "manual", "never" }
local MAX_INTERVAL_MIN = 10080
local USD_DECIMALS = 6
local SHOWN_BYTES, HEAD_BYTES, TAIL_BYTES = 72, 48, 16
local PATH_MAX, NAME_MAX = 4096, 255
local MAX_WORLD_PATHS, MAX_WORLD_BYTES = 32, 16384

local function here()
  local source = debug.getinfo(1, "S").source
  return (string.match(source, "^@(.*)/[^/]*$")) or "."
end
local POLICY_FILE = here() .. "/geo_policy.lua"

-- An error carries its message and the Slurm code to return.
local function fail(message, code)
  error({ message = message, code = code }, 0)
end
local function malformed(message) fail(message, slurm.ERROR) end
local function forbidden(message) fail(message, slurm.ESLURM_ACCESS_DENIED or slurm.ERROR) end

-- A UTF-8 continuation byte: no character starts there.
local function continues(text, at)
  local byte = string.byte(text, at)
  return byte ~= nil and byte >= 128 and byte < 192
end

-- A long value is shown by its head and tail, cut where characters start, as Python's
-- quote() does: messages stay one short line.
local function quote(value)
  local shown = string.gsub(value, "%c", "?")
  if #shown > SHOWN_BYTES then
    local head_end, tail_start = HEAD_BYTES, #shown - TAIL_BYTES + 1
    while continues(shown, head_end + 1) do head_end = head_end - 1 end
    while continues(shown, tail_start) do tail_start = tail_start + 1 end
    shown = string.sub(shown, 1, head_end) .. "..." .. string.sub(shown, tail_start)
  end
  return "'" .. shown .. "'"
end

local function contains(list, value)
  for _, item in ipairs(list) do
    if item == value then return true end
  end
  return false
end

local function split(value)
  local parts, start = {}, 1
  while true do
    local comma = string.find(value, ",", start, true)
    if not comma then
      table.insert(parts, string.sub(value, start))
      return parts
    end
    table.insert(parts, string.sub(value, start, comma - 1))
    start = comma + 1
  end
end

local function is_name(value)
  return #value <= 64 and string.find(value, "^[%w][%w%._%-]*$") ~= nil
end

-- --- parsing: mirrors slurm_geo/policy/directives.py ---------------------------------

local function reject(option, value, why)
  malformed("geo: --" .. option .. ": " .. quote(value) .. " " .. why)
end

local PARSE = {}
local function absolute_path(value, option)
  if string.sub(value, 1, 1) ~= "/" or string.find(value, "[%z\n\r]") then
    reject(option, value, "is not an absolute path")
  end
  local parts = {}
  for part in string.gmatch(value, "[^/]+") do
    if part ~= "." then table.insert(parts, part) end
  end
  for _, part in ipairs(parts) do
    if part == ".." then reject(option, value, "contains '..'; name the directory without it") end
  end
  for _, part in ipairs(parts) do
    if #part > NAME_MAX then
      reject(option, value, "has a component longer than " .. NAME_MAX .. " bytes (NAME_MAX)")
    end
  end
  local normal = "/" .. table.concat(parts, "/")
  if #normal >= PATH_MAX then
    reject(option, value, "is " .. #normal .. " bytes long; paths are at most " ..
      (PATH_MAX - 1) .. " (PATH_MAX)")
  end
  return normal
end
PARSE["geo-ckpt-dir"] = absolute_path

-- The paths of a job's world (--geo-inputs, --geo-env, --geo-outputs): only their syntax
-- is checked here, as root on the controller; nothing is looked up on disk.
local function world_path(path, option)
  local normal = absolute_path(path, option)
  if normal == "/" then
    reject(option, path, "is the root directory; name the directories and files the job uses")
  end
  return normal
end
-- A list of {path = ..., class = ... or nil}; with `classes`, an entry may end in :CLASS.
local function path_list(value, option, classes)
  if #value > MAX_WORLD_BYTES then
    reject(option, value, "is " .. #value .. " bytes long; a list is at most " ..
      MAX_WORLD_BYTES .. ": name the directories that hold the files")
  end
  local entries, out, seen = split(value), {}, {}
  if #entries > MAX_WORLD_PATHS then
    reject(option, value, "names " .. #entries .. " paths; at most " .. MAX_WORLD_PATHS ..
      ": name the directories that hold them")
  end
  for _, entry in ipairs(entries) do
    if entry == "" then
      reject(option, value, "has an empty entry (two commas, or one at an end)")
    end
    local path, class = entry, nil
    if classes and string.find(entry, ":", 1, true) then
      path, class = string.match(entry, "^(.*):([^:]*)$")
      if not contains(DATA_CLASSES, class) then
        reject(option, entry, "ends in " .. quote(":" .. class) .. ", not a data class (" ..
          table.concat(DATA_CLASSES, ", ") .. "): write PATH or PATH:CLASS (a path with " ..
          "':' needs its class after it)")
      end
    end
    if string.sub(path, 1, 1) ~= "/" then reject(option, entry, "is not an absolute path") end
    local normal = world_path(path, option)
    if seen[normal] then reject(option, value, "names " .. quote(normal) .. " twice") end
    seen[normal] = true
    table.insert(out, { path = normal, class = class })
  end
  return out
end
PARSE["geo-inputs"] = function(value, option) return path_list(value, option, true) end
PARSE["geo-outputs"] = function(value, option) return path_list(value, option, false) end
PARSE["geo-env"] = function(value, option)
  if string.find(value, ",", 1, true) then
    reject(option, value, "names more than one path; a job has one environment")
  end
  return world_path(value, option)
end
PARSE["geo-ckpt-interval"] = function(value, option)
  local minutes = string.find(value, "^%d+$") and #value <= 6 and tonumber(value)
  if not minutes or minutes < 1 or minutes > MAX_INTERVAL_MIN then
    reject(option, value, "is not a whole number of minutes from 1 to " .. MAX_INTERVAL_MIN)
  end
  return minutes
end
local function names(value, option)
  local parts, seen = split(value), {}
  for _, name in ipairs(parts) do
    if not is_name(name) then reject(option, value, "is not a comma-separated list of names") end
  end
  for _, name in ipairs(parts) do
    if seen[name] then reject(option, value, "names one entry twice") end
    seen[name] = true
  end
  return parts
end
PARSE["geo-residency"] = names
PARSE["geo-clusters"] = names
local function one_of(choices)
  return function(value, option)
    if not contains(choices, value) then
      reject(option, value, "is not one of " .. table.concat(choices, ", "))
    end
    return value
  end
end
PARSE["geo-data-class"] = one_of(DATA_CLASSES)
PARSE["geo-failover"] = one_of(FAILOVER_MODES)
PARSE["geo-cost-center"] = function(value, option)
  if not is_name(value) then
    reject(option, value,
      "must be 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit")
  end
  return value
end
PARSE["geo-max-cost"] = function(value, option)
  local units, decimals = string.match(value, "^(%d+)%.(%d+)$")
  units = units or string.match(value, "^(%d+)$")
  local usd = units and #units <= 9 and #(decimals or "") <= USD_DECIMALS and tonumber(value)
  if not usd or usd <= 0 then
    reject(option, value, "is not an amount of USD greater than 0, with at most " ..
      USD_DECIMALS .. " decimals (e.g. 250, 99.50 or 0.001)")
  end
  return usd
end

-- An option written without =VALUE takes the next word, after `#SBATCH --geo-NAME` the
-- next line's option, which would be lost: refused.
local function given(value, option)
  if value == "" then
    malformed("geo: --" .. option .. " has no value; write --" .. option .. "=VALUE")
  end
  if string.find(value, "^%-%-") or string.find(value, "^%-%a") then
    malformed("geo: --" .. option .. " has no value (it took the next option, " ..
      quote(value) .. "); write --" .. option .. "=VALUE on one line")
  end
  return value
end

local function parse(raw)
  local d = {}
  for _, spec in ipairs(SPECS) do
    local value = raw[spec.env]
    if value ~= nil then
      d[spec.option] = PARSE[spec.option](given(value, spec.option), spec.option)
    end
  end
  return d
end

-- --- the rules: mirrors slurm_geo/policy/geo.py --------------------------------------

local function allowed_regions(policy, data_class)
  return policy.data_classes[data_class] or policy.regions
end

local function check_known(d, policy)
  for _, region in ipairs(d["geo-residency"] or {}) do
    if not contains(policy.regions, region) then
      malformed("geo: --geo-residency: unknown region " .. quote(region) .. " (known: " ..
        table.concat(policy.regions, ", ") .. ")")
    end
  end
  for _, name in ipairs(d["geo-clusters"] or {}) do
    if policy.cluster_regions[name] == nil then
      malformed("geo: --geo-clusters: unknown cluster " .. quote(name) .. " (known: " ..
        table.concat(policy.cluster_names, ", ") .. ")")
    end
  end
end

-- An output overlapping what is read-only where the job moves: its inputs, its env.
local function inside(path, other)
  return string.sub(path, 1, #other + 1) == other .. "/"
end
local function check_world(d)
  local read_only = {}
  for _, input in ipairs(d["geo-inputs"] or {}) do
    table.insert(read_only, { what = "the input", path = input.path })
  end
  if d["geo-env"] ~= nil then
    table.insert(read_only, { what = "the --geo-env", path = d["geo-env"] })
  end
  for _, output in ipairs(d["geo-outputs"] or {}) do
    for _, item in ipairs(read_only) do
      local relation = nil
      if output.path == item.path then relation = "is"
      elseif inside(output.path, item.path) then relation = "is inside"
      elseif inside(item.path, output.path) then relation = "holds" end
      if relation ~= nil then
        malformed("geo: --geo-outputs: " .. quote(output.path) .. " " .. relation .. " " ..
          item.what .. " " .. quote(item.path) .. ", read-only where the job moves; " ..
          "write the outputs outside it")
      end
    end
  end
end

local function effective_residency(d, policy)
  return d["geo-residency"] or
    allowed_regions(policy, d["geo-data-class"] or policy.default_data_class)
end

-- {input, regions} of the inputs whose own data class keeps the job out of some region
-- of its residency.
local function narrowing_inputs(d, policy)
  local residency, found = effective_residency(d, policy), {}
  for _, input in ipairs(d["geo-inputs"] or {}) do
    if input.class ~= nil then
      local allowed = allowed_regions(policy, input.class)
      for _, region in ipairs(residency) do
        if not contains(allowed, region) then
          table.insert(found, { input = input, allowed = allowed })
          break
        end
      end
    end
  end
  return found
end

local function placement_regions(d, policy)
  local regions = effective_residency(d, policy)
  for _, narrowing in ipairs(narrowing_inputs(d, policy)) do
    local kept = {}
    for _, region in ipairs(regions) do
      if contains(narrowing.allowed, region) then table.insert(kept, region) end
    end
    regions = kept
  end
  return regions
end

local function check_inputs(d, policy, cluster)
  local here = policy.cluster_regions[cluster]
  for _, input in ipairs(d["geo-inputs"] or {}) do
    if input.class ~= nil then
      local allowed = allowed_regions(policy, input.class)
      if not contains(allowed, here) then
        forbidden("geo: --geo-inputs: " .. quote(input.path) .. " is data class " ..
          quote(input.class) .. ", which may not reside in region " .. quote(here) ..
          " of cluster " .. quote(cluster) .. " (allowed: " .. table.concat(allowed, ", ") ..
          ")")
      end
    end
  end
end

local function check_residency(d, policy, cluster)
  local data_class = d["geo-data-class"] or policy.default_data_class
  local allowed = allowed_regions(policy, data_class)
  for _, region in ipairs(d["geo-residency"] or {}) do
    if not contains(allowed, region) then
      forbidden("geo: data class " .. quote(data_class) .. " may not reside in region " ..
        quote(region) .. " (allowed: " .. table.concat(allowed, ", ") .. ")")
    end
  end
  local residency = d["geo-residency"] or allowed
  local region = policy.cluster_regions[cluster]
  if not contains(residency, region) then
    forbidden("geo: cluster " .. quote(cluster) .. " is in region " .. quote(region) ..
      ", outside the job's residency (" .. table.concat(residency, ", ") .. ")")
  end
  for _, name in ipairs(d["geo-clusters"] or {}) do
    if not contains(residency, policy.cluster_regions[name]) then
      forbidden("geo: --geo-clusters: cluster " .. quote(name) .. " is in region " ..
        quote(policy.cluster_regions[name]) .. ", outside the job's residency (" ..
        table.concat(residency, ", ") .. ")")
    end
  end
end

-- --geo-failover=auto with no other cluster its residency and --geo-clusters allow.
local function check_failover_possible(d, policy, cluster)
  if d["geo-failover"] ~= "auto" then return end
  local regions = placement_regions(d, policy)
  local clusters = d["geo-clusters"]
  for _, name in ipairs(policy.cluster_names) do
    if name ~= cluster and contains(regions, policy.cluster_regions[name])
        and (clusters == nil or contains(clusters, name)) then
      return
    end
  end
  local parts = { "its residency (" .. table.concat(effective_residency(d, policy), ", ") .. ")" }
  for _, narrowing in ipairs(narrowing_inputs(d, policy)) do
    table.insert(parts, "input " .. quote(narrowing.input.path) .. " of data class " ..
      quote(narrowing.input.class) .. " (" .. table.concat(narrowing.allowed, ", ") .. ")")
  end
  if clusters ~= nil then
    table.insert(parts, "--geo-clusters (" .. table.concat(clusters, ",") .. ")")
  end
  local limits = table.concat(parts, " and ") .. (#parts == 1 and " leaves" or " leave")
  malformed("geo: --geo-failover=auto can never move this job: " .. limits ..
    " no cluster but " .. quote(cluster) .. "; write --geo-failover=never, or " ..
    "allow another cluster")
end

local function check_budget(d, policy)
  local center = d["geo-cost-center"]
  if #policy.budget_names == 0 or center == nil then return end
  local budget = policy.budgets[center]
  if budget == nil then
    forbidden("geo: --geo-cost-center: unknown cost center " .. quote(center) ..
      " (known: " .. table.concat(policy.budget_names, ", ") .. ")")
  end
  local max_cost = d["geo-max-cost"]
  if max_cost ~= nil and max_cost > budget then
    forbidden(string.format("geo: --geo-max-cost=%g exceeds the budget of cost center %s " ..
      "(%g USD)", max_cost, quote(center), budget))
  end
end

local function check(d, policy, cluster)
  if policy.cluster_regions[cluster] == nil then
    malformed("geo: cluster " .. quote(cluster) .. " is not in the slurm-geo config (known: " ..
      table.concat(policy.cluster_names, ", ") .. ")")
  end
  check_known(d, policy)
  local clusters = d["geo-clusters"]
  if clusters ~= nil and not contains(clusters, cluster) then
    malformed("geo: --geo-clusters: " .. quote(table.concat(clusters, ",")) .. " leaves out " ..
      quote(cluster) .. ", the cluster this job is submitted to: name it too, or submit " ..
      "the job to a cluster it names")
  end
  if d["geo-failover"] == "auto" and d["geo-ckpt-dir"] == nil then
    malformed("geo: --geo-failover=auto needs --geo-ckpt-dir=PATH: a job moves with its " ..
      "checkpoints")
  end
  if policy.require_cost_center and d["geo-cost-center"] == nil then
    malformed("geo: this site requires --geo-cost-center=NAME on jobs with --geo-* directives")
  end
  check_world(d)
  check_residency(d, policy, cluster)
  check_inputs(d, policy, cluster)
  check_failover_possible(d, policy, cluster)
  check_budget(d, policy)
end

-- --- what billing reads back --------------------------------------------------------

-- sacct and slurmrestd do not show a job's environment, so the cost center is recorded in
-- the admin comment ("geo:cost_center=NAME", after any comment already there), where
-- `slurm-geo billing ingest` finds it (slurm_geo/billing/attribution.py).
local function record_for_billing(job_desc, d)
  local center = d["geo-cost-center"]
  if center == nil then return end
  local tag = "geo:cost_center=" .. center
  local current = job_desc.admin_comment
  if current == nil or current == "" then
    job_desc.admin_comment = tag
  elseif not string.find(current, tag, 1, true) then
    job_desc.admin_comment = current .. " " .. tag
  end
end

-- --- where directives come from ------------------------------------------------------

local function from_spank_env(job_desc)
  local env, found, any = job_desc.spank_job_env, {}, false
  if type(env) ~= "table" then return nil end
  for _, entry in pairs(env) do
    local name, value = string.match(entry, "^GEO_([A-Z_]+)=(.*)$")
    if name then
      found[name] = value
      any = true
    end
  end
  return any and found or nil
end

-- sbatch copies the SPANK plugin's hand-over (GEO_<NAME>) into the job's environment as
-- SLURM_SPANK_GEO_<NAME>, where the federation daemon reads a pending job's directives. A
-- user can put such a variable in their own environment, or send it through a client that
-- skips the plugin (slurmrestd): the name of the first one the plugin did not hand over,
-- with that value, so the job can be refused (nil: none).
local function forged_spank_env(job_desc)
  local env = job_desc.environment
  if job_desc.script == nil or env == nil then return nil end
  local handed, spank = {}, job_desc.spank_job_env
  if type(spank) == "table" then
    for _, entry in pairs(spank) do
      local name, value = string.match(entry, "^GEO_([A-Z_]+)=(.*)$")
      if name then handed[name] = value end
    end
  end
  for _, spec in ipairs(SPECS) do
    local value = env["SLURM_SPANK_GEO_" .. spec.env]
    if value ~= nil and handed[spec.env] ~= value then
      return "SLURM_SPANK_GEO_" .. spec.env, spec.option
    end
  end
  return nil
end

local function from_job_env(job_desc)
  if job_desc.script == nil then return nil end -- only batch jobs carry an environment
  local env, found, any = job_desc.environment, {}, false
  if env == nil then return nil end
  for _, spec in ipairs(SPECS) do
    local value = env["SLURM_GEO_" .. spec.env]
    if value ~= nil then
      found[spec.env] = value
      any = true
    end
  end
  return any and found or nil
end

-- Returns slurm.SUCCESS, or an error code after telling the user why (slurm.log_user).
function geo_job_submit(job_desc, submit_uid)
  local forged, option = forged_spank_env(job_desc)
  if forged ~= nil then
    local message = "geo: " .. forged .. " is in the job's environment but the SPANK " ..
      "plugin did not set it; unset it (a job started from a geo job inherits it) and " ..
      "ask with #SBATCH --" .. option
    slurm.log_info("geo: rejected a job of uid %s: %s", tostring(submit_uid), message)
    slurm.log_user("%s", message)
    return slurm.ERROR
  end
  local raw = from_spank_env(job_desc) or from_job_env(job_desc)
  if raw == nil then return slurm.SUCCESS end
  local ok, err = pcall(function()
    local loaded, policy = pcall(dofile, POLICY_FILE)
    if not loaded then
      fail("geo: the site's policy " .. POLICY_FILE .. " cannot be read; ask your admin " ..
        "to run `slurm-geo policy export-lua`", slurm.ERROR)
    end
    local d = parse(raw)
    check(d, policy, policy.cluster)
    if d["geo-ckpt-dir"] ~= nil and job_desc.requeue == NO_VAL16 then
      job_desc.requeue = 1
    end
    record_for_billing(job_desc, d)
  end)
  if ok then return slurm.SUCCESS end
  if type(err) ~= "table" then err = { message = "geo: " .. tostring(err), code = slurm.ERROR } end
  slurm.log_info("geo: rejected a job of uid %s: %s", tostring(submit_uid), err.message)
  slurm.log_user("%s", err.message)
  return err.code
end

function slurm_job_submit(job_desc, part_list, submit_uid)
  return geo_job_submit(job_desc, submit_uid)
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
  return slurm.SUCCESS
end
