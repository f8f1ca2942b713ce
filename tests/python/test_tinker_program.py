"""A program written only against Tinker's public API (tinker_program.py)
runs unchanged on a real tally-server, each phase in a fresh process: SL
lowers the loss, RL with sampling raises the reward, a refused call is
Tinker's BadRequestError, the saved state resumes from its path alone with
the same loss (on the server that saved it, and on a new server process
that reads the base again), a base changed since the save is refused, and
the RestClient lists, downloads and deletes the state.

The base model is a tiny HF Llama directory written by the test (what a
Tinker program names as "Qwen/Qwen3-8B" is, on tally, a directory the
server reads). Seeded sampling and a single-rank server make every run the
same."""

import json
import os
import shutil
import subprocess
import sys
import unittest

from hf_reference import hf_config, random_weights, write_hf_model
from tally_testing import ServerTestCase

CONFIG = hf_config("llama", vocab_size=16, hidden_size=32,
                   intermediate_size=48, num_attention_heads=4,
                   num_key_value_heads=2, num_hidden_layers=2,
                   max_position_embeddings=64, rms_norm_eps=1e-5)
PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                       "tinker_program.py")
TIMEOUT = 300


class TinkerProgramTest(ServerTestCase):

    def run_program(self, phase, server, *args, check=True):
        """The JSON report of tinker_program.py `phase` run against `server`
        with `args` in a new process (with check=False: the finished
        process when it failed)."""
        out = os.path.join(self.temp_dir, f"{phase}-{server.grpc_port}.json")
        done = subprocess.run(
            [sys.executable, PROGRAM, phase, f"localhost:{server.grpc_port}",
             *args, out],
            capture_output=True, text=True, timeout=TIMEOUT, check=False)
        if not check and done.returncode != 0:
            return done
        self.assertEqual(done.returncode, 0, done.stderr[-4000:])
        with open(out, encoding="utf-8") as f:
            return json.load(f)

    def test_sl_rl_save_and_resume_in_a_new_process(self):
        base = os.path.join(self.temp_dir, "base")
        write_hf_model(base, CONFIG, random_weights(CONFIG, seed=5),
                       storage="f32")
        args = ["--checkpoint-root", self.temp_dir]
        self.start_server(extra_args=args)
        report = self.run_program("train", self.server, base)

        losses = report["sl_losses"]
        self.assertLess(losses[-1], 0.5 * losses[0], losses)
        self.assertEqual(report["output_type"], "ArrayRecord")
        # tally's optim_step metrics are its extras, so a loop that merges
        # them into its own finds no "step" or "learning_rate" overwritten.
        metrics = report["optim_metrics"]
        self.assertEqual(metrics["tally/step"], 6.0)
        self.assertFalse([name for name in metrics
                          if not name.startswith("tally/")], metrics)

        rewards = report["rewards"]
        self.assertGreater(rewards[-1], rewards[0] + 0.3, rewards)
        first = report["rl_metrics"][0]
        # Without a mask, the positions padded with logprob 0 and advantage
        # 0 (the prompt's) are not sampled tokens: the statistics count
        # the 16 x 4 sampled ones only, and the sampler's logprobs are the
        # trainer's own.
        self.assertEqual(first["tally/policy_tokens:sum"], 16 * 4)
        self.assertAlmostEqual(first["tally/ratio:mean"], 1.0, delta=1e-5)
        self.assertLess(first["tally/logprob_gap:max"], 1e-5)

        self.assertEqual(report["refused"],
                         ["InvalidArgumentError", 400, True])
        self.assertEqual(report["info"], base)

        state = report["state_path"]
        self.assertTrue(state.startswith("tally://"), state)

        # The base is still in memory on the server that saved the state.
        resumed = self.run_program("resume", self.server, state)
        self.assertEqual(resumed["loss"], report["loss_at_save"])
        # A new server process reads it again from the path the state names.
        second = self.start_server(extra_args=args, name="second").server
        resumed = self.run_program("resume", second, state)
        self.assertEqual(resumed["loss"], report["loss_at_save"])

        # A state naming a base outside the caller's root is refused before
        # anything is read from there.
        forged = os.path.join(self.temp_dir, "forged")
        shutil.copytree(os.path.join(self.temp_dir, state[len("tally://"):]),
                        forged)
        with open(os.path.join(forged, "tally.json"), encoding="utf-8") as f:
            manifest = json.load(f)
        manifest["base_checkpoint"] = os.path.dirname(self.temp_dir)
        with open(os.path.join(forged, "tally.json"), "w",
                  encoding="utf-8") as f:
            json.dump(manifest, f)
        refused = self.run_program("resume", second, "forged", check=False)
        self.assertNotEqual(refused.returncode, 0)
        self.assertIn("PERMISSION_DENIED", refused.stderr)
        self.assertIn("is outside this caller's roots", refused.stderr)

        # A base replaced since the save is not the adapter's.
        write_hf_model(base, CONFIG, random_weights(CONFIG, seed=6),
                       storage="bf16")
        refused = self.run_program("resume", second, state, check=False)
        self.assertNotEqual(refused.returncode, 0)
        self.assertIn("FAILED_PRECONDITION", refused.stderr)
        self.assertIn(f"the LoRA base {base} of adapter state", refused.stderr)

        rest = self.run_program("rest", second, state)
        self.assertEqual(rest["before"][state], ["training", True, True])
        self.assertIn("tally.json", rest["files"])
        self.assertIn("config.json", rest["files"])
        self.assertNotIn(state, rest["after"])

if __name__ == "__main__":
    unittest.main()
