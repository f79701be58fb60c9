"""`python3 -m zinf.torchrun ...`: torch's own launcher (torch.distributed.run, what the
`torchrun` command runs), arguments and behaviour unchanged, with one fix for Debian 12.

Debian 12 ships torch 1.13 with Python 3.11. There torchrun fails before starting a worker
("'NoneType' object has no attribute 'get'"): its Std.from_str looks a --redirects / --tee value
up by iterating the IntFlag Std, and since Python 3.11 that iteration yields only the one-bit
members (OUT, ERR), so the default "0" (NONE) maps to None. The fix maps the value with Std(v).
Where torchrun works as it is (another torch or Python), nothing is changed.
"""
import re
import sys


def _fix_std():
    from torch.distributed.elastic.multiprocessing import api
    if api.Std.from_str("0") is not None:
        return  # this torch's launcher is fine

    def from_str(cls, vm):
        if re.match(api._VALUE_REGEX, vm):
            return cls(int(vm))
        if re.match(api._MAPPING_REGEX, vm):
            return {int(i): cls(int(v)) for i, v in (m.split(":") for m in vm.split(","))}
        raise ValueError("%s does not match: <%s> or <%s>"
                         % (vm, api._VALUE_REGEX, api._MAPPING_REGEX))

    api.Std.from_str = classmethod(from_str)


def main(argv=None):
    _fix_std()
    from torch.distributed import run
    run.main(argv)


if __name__ == "__main__":
    sys.exit(main())
