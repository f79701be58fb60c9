"""deepspeed.utils.zero_to_fp32 (zinf): a zinf checkpoint is not DeepSpeed's ZeRO layout; export
the fp32 weights from a live engine with zinf.save_safetensors (streaming, bounded memory)."""
import zinf


def _refuse(name):
    raise zinf.ZinfError("deepspeed.utils.zero_to_fp32.%s: zinf's checkpoints are not DeepSpeed's "
                         "ZeRO files; load the checkpoint into an engine (engine.load_checkpoint) "
                         "and write the fp32 weights with zinf.save_safetensors(engine, path)"
                         % name)


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None, **kwargs):
    _refuse("get_fp32_state_dict_from_zero_checkpoint")


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_file, tag=None, **kwargs):
    _refuse("convert_zero_checkpoint_to_fp32_state_dict")


def load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None):
    _refuse("load_state_dict_from_zero_checkpoint")
