"""Plants for hf2mcore's staging (issue 27): each breaks one property; the listed default-lane tests must fail.

hf2mcore writes its engine checkpoint into a hidden staging directory next to --save-dir, verifies it there and
renames it to --save-dir only on success (megatron_patch/conversion/convert.py: publish()); the checkpoint's
stored configuration names --save-dir.
"""
FAMILIES = "tests/test_conversion_families.py"
FAILED_VERIFY = f"{FAMILIES}::test_planted_import_error_fails_verify[untransposed_conv1d]"
RESUMES = f"{FAMILIES}::test_converted_checkpoint_is_published_where_asked_and_resumes"
MOE = "tests/test_conversion_today.py::test_each_family_converts_verifies_and_comes_back_bit_for_bit[qwen3_moe]"
PUBLISH = "tests/test_conversion_export.py::test_publish_renames_only_a_complete_conversion"

PLANTS = [
    dict(name="staging-left-on-exception", file="megatron_patch/conversion/convert.py",
         original="        shutil.rmtree(staging, ignore_errors=True)  # gone already when published",
         replacement="        if status:  # a failed conversion (a published one was renamed)\n"
                     "            shutil.rmtree(staging, ignore_errors=True)",
         property="a conversion that raises or is interrupted (Ctrl-C) leaves no staging directory behind",
         tests=[PUBLISH]),
    dict(name="worker-saves-to-save-dir", file="megatron_patch/conversion/worker.py",
         original="consume_model=True, root=args.save_dir)",
         replacement="consume_model=True, root=cfg.save)",
         property="hf2mcore's workers write into the staging directory, not straight into --save-dir (a failed "
                  "verify or an interrupted conversion would leave a checkpoint there)",
         tests=[FAILED_VERIFY, MOE]),
    dict(name="workers-given-save-dir", file="megatron_patch/conversion/convert.py",
         original='["hf2mcore", "--load-dir", a.load_dir, "--save-dir", staging,',
         replacement='["hf2mcore", "--load-dir", a.load_dir, "--save-dir", a.save_dir,',
         property="hf2mcore starts its workers on the staging directory, not on --save-dir (where a failed verify "
                  "would leave the checkpoint behind)",
         tests=[FAILED_VERIFY, MOE]),
    dict(name="stored-save-is-staging", file="megatron_patch/conversion/convert.py",
         original='"--publish-dir", a.save_dir, ',
         replacement="",
         property="the converted checkpoint's stored configuration (checkpoint.json config.save) names --save-dir, "
                  "not the staging directory it was written in",
         tests=[RESUMES, MOE]),
]
