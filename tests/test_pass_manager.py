"""Pass manager, registry and pipeline strings; the custom-pass example; plugins and entry points."""

from __future__ import annotations

import io
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from dapple_ir.errors import DappleError, PassError, PassOptionError
from dapple_ir.ir import Module
from dapple_ir.ir.parser import parse_module
from dapple_ir.ir.printer import print_module
from dapple_ir.ir.verifier import verify_module
from dapple_ir.pass_manager import PassManager, build_pipeline, pipeline_spec
from dapple_ir.plugins import all_passes, load_plugin
from dapple_ir.registry import Pass, PassContext, lookup_pass, option, register_pass

ROOT = Path(__file__).resolve().parent.parent
MLP = """module @mlp attributes {batch = 2} {
  param @fc1.weight : f32[4,4]
  param @head.weight : f32[1,4]

  %x = input : f32[2,4] {index = 0}
  %h = call_module @fc1(%x) : f32[2,4] {module_path = "fc1", params = [@fc1.weight]}
  %dead = call_method @clone(%h) : f32[2,4]
  %r = call_function @torch.relu(%h) : f32[2,4] {module_path = "fc1"}
  %y = call_module @head(%r) : f32[2,1] {module_path = "head", params = [@head.weight]}
  %l = call_function @torch.sum(%y) : f32[] {module_path = "head"}
  %o = output(%l) : f32[]

  stage @s0 [%x, %h, %dead, %r, %y] {replicas = 1, devices = [0]}
  stage @s1 [%l, %o] {replicas = 1, devices = [1]}
}
"""


@register_pass
@dataclass(frozen=True)
class _BreakSSA(Pass):
    """Test pass that breaks the IR (reverses the op order)."""

    name = "test-break-ssa"

    def apply(self, ctx: PassContext, module: Module) -> None:
        module.ops.reverse()


@register_pass
@dataclass(frozen=True)
class _Options(Pass):
    """Test pass with one option of each kind."""

    name = "test-options"
    count: int = 3
    ratio: float = 0.5
    flag: bool = False
    path: str = "auto"

    def apply(self, ctx: PassContext, module: Module) -> None:
        raise DappleError(f"refusing on purpose (count={self.count})")


def test_pipeline_spec_round_trips() -> None:
    text = 'dce,test-options{count=7,flag=true,path="a b,c.json"},verify'
    passes = build_pipeline(text)
    assert [p.name for p in passes] == ["dce", "test-options", "verify"]
    opts = passes[1]
    assert (opts.count, opts.ratio, opts.flag, opts.path) == (7, 0.5, True, "a b,c.json")  # type: ignore[attr-defined]
    assert pipeline_spec(passes) == text
    assert pipeline_spec(build_pipeline(pipeline_spec(passes))) == text


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("dce,bogus", "unknown pass 'bogus'; registered passes are: "),
        ("test-options{colour=red}", "has no option 'colour'; its options are: count, ratio, flag, path"),
        ("test-options{count=many}", "option 'count' of pass 'test-options' must be int, not 'many'"),
        ("test-options{flag=maybe}", "must be bool"),
        ("dce{", "<pipeline>:1:5"),
    ],
)
def test_bad_pipelines(text: str, says: str) -> None:
    with pytest.raises(DappleError) as info:
        build_pipeline(text)
    assert says in str(info.value)


@register_pass
@dataclass(frozen=True)
class _Typed(Pass):
    """Test pass with optional and tuple options, declared with `option`."""

    name = "test-typed"
    stages: int | None = option(None, "a count, or auto")
    ratio: float | None = option(0.5, "a fraction, or auto")
    label: str | None = option(None, "a name, or auto")
    devices: tuple[int, ...] = option((), "device ids")
    names: tuple[str, ...] = option(("a", "b c"), "names")

    def apply(self, ctx: PassContext, module: Module) -> None:
        pass


def test_optional_and_tuple_options_convert_by_annotation() -> None:
    (p,) = build_pipeline('test-typed{stages=4,ratio=auto,label=x,devices=0;1;2,names="x,y;z"}')
    assert p == _Typed(stages=4, ratio=None, label="x", devices=(0, 1, 2), names=("x,y", "z"))
    (p,) = build_pipeline('test-typed{stages=auto,devices="",names=one}')
    assert p == _Typed(stages=None, devices=(), names=("one",))
    assert build_pipeline("test-typed") == [_Typed()]


@pytest.mark.parametrize(
    "p",
    [
        _Typed(),
        _Typed(stages=3, ratio=None, label="a b", devices=(4, 5), names=()),
        _Typed(label="x,y", names=("p", "q r")),
        _Options(count=-1, ratio=2.5, flag=True, path='say "hi"'),
    ],
)
def test_spec_rebuilds_an_equal_pass(p: Pass) -> None:
    assert build_pipeline(p.spec()) == [p]


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("test-typed{stages=many}", "option 'stages' of pass 'test-typed' must be int or auto, not 'many'"),
        ("test-typed{ratio=half}", "option 'ratio' of pass 'test-typed' must be float or auto, not 'half'"),
        ("test-typed{devices=0;x}", "option 'devices' of pass 'test-typed' must be int values separated by ';'"),
    ],
)
def test_bad_typed_options_name_pass_option_type_and_text(text: str, says: str) -> None:
    with pytest.raises(PassOptionError) as info:
        build_pipeline(text)
    assert says in str(info.value)


def test_a_pass_without_apply_is_abstract() -> None:
    @dataclass(frozen=True)
    class NoApply(Pass):
        name = "test-no-apply"

    with pytest.raises(TypeError, match="abstract"):
        NoApply()  # type: ignore[abstract]
    with pytest.raises(PassOptionError, match="must define apply"):
        register_pass(NoApply)


def test_register_rejects_unsupported_option_types() -> None:
    with pytest.raises(PassOptionError, match="option 'sizes' of pass 'test-list' has type"):

        @register_pass
        @dataclass(frozen=True)
        class Listy(Pass):
            name = "test-list"
            sizes: list[int] | None = None

            def apply(self, ctx: PassContext, module: Module) -> None:
                pass


def test_unknown_pass_lists_builtins() -> None:
    all_passes()
    with pytest.raises(PassOptionError) as info:
        lookup_pass("nope")
    assert "dce" in str(info.value) and "verify" in str(info.value)


def test_dce_removes_unused_op_everywhere() -> None:
    module = parse_module(MLP)
    PassManager(build_pipeline("dce")).run(module)
    text = print_module(module)
    assert "%dead" not in text
    assert "stage @s0 [%x, %h, %r, %y]" in text


def test_verify_after_each_pass_names_the_pass() -> None:
    with pytest.raises(PassError) as info:
        PassManager(build_pipeline("dce,test-break-ssa,verify")).run(parse_module(MLP))
    message = str(info.value)
    assert "after pass 'test-break-ssa'" in message and "before its definition" in message


def test_no_verify_lets_broken_ir_through() -> None:
    module = parse_module(MLP)
    PassManager(build_pipeline("test-break-ssa"), verify=False).run(module)
    assert module.ops[0].name == "o"


def _counting_verifies(monkeypatch: pytest.MonkeyPatch) -> list[Module]:
    """Every module `verify_module` is called on, by the manager or the verify pass."""
    from dapple_ir import pass_manager
    from dapple_ir.passes import verify

    calls: list[Module] = []

    def counted(module: Module) -> None:
        calls.append(module)
        verify_module(module)

    monkeypatch.setattr(pass_manager, "verify_module", counted)
    monkeypatch.setattr(verify, "verify_module", counted)
    return calls


@pytest.mark.parametrize("pipeline", ["verify", "dce,verify", "dce,verify,verify"])
def test_a_verifying_manager_verifies_each_state_of_the_module_once(
    pipeline: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The input and what each pass but `verify` leaves, once each: the verify pass does not verify again what the
    manager verified right before it."""
    calls = _counting_verifies(monkeypatch)
    PassManager(build_pipeline(pipeline)).run(parse_module(MLP))
    assert len(calls) == 1 + pipeline.count("dce")


def test_the_verify_pass_verifies_where_no_manager_did() -> None:
    """Under `--no-verify`, and applied alone, the verify pass verifies the structure itself."""
    with pytest.raises(
        PassError, match=r"pass 'verify' failed \(after test-break-ssa\): verify: .* before its definition"
    ):
        PassManager(build_pipeline("test-break-ssa,verify"), verify=False).run(parse_module(MLP))
    module = parse_module(MLP)
    module.ops.reverse()
    with pytest.raises(DappleError, match="before its definition"):
        lookup_pass("verify")().apply(PassContext(), module)


def test_a_verify_pass_first_checks_the_input_once_by_the_manager(monkeypatch: pytest.MonkeyPatch) -> None:
    module = parse_module(MLP)
    module.ops.reverse()
    calls = _counting_verifies(monkeypatch)
    with pytest.raises(PassError, match=r"the IR after the input does not verify: verify: .* before its definition"):
        PassManager(build_pipeline("verify,verify")).run(module)
    assert len(calls) == 1


def test_failing_pass_names_itself_and_the_passes_before() -> None:
    with pytest.raises(PassError) as info:
        PassManager(build_pipeline("dce,verify,test-options{count=9}")).run(parse_module(MLP))
    message = str(info.value)
    assert "pass 'test-options{count=9}' failed (after dce, verify): refusing on purpose (count=9)" in message


def test_print_dump_and_time(tmp_path: Path) -> None:
    out = io.StringIO()
    manager = PassManager(
        build_pipeline("dce,verify"), print_ir_after={"dce"}, dump_dir=tmp_path / "dump", time_passes=True, out=out
    )
    module = manager.run(parse_module(MLP))
    text = out.getvalue()
    assert "// ----- IR after dce -----" in text and "IR after verify" not in text
    assert "pass timings" in text and "total" in text
    dumps = sorted(p.name for p in (tmp_path / "dump").iterdir())
    assert dumps == ["000_input.dapple", "001_dce.dapple", "002_verify.dapple"]
    assert (tmp_path / "dump" / "002_verify.dapple").read_text() == print_module(module)
    assert "%dead" in (tmp_path / "dump" / "000_input.dapple").read_text()


def test_print_after_all() -> None:
    out = io.StringIO()
    PassManager(build_pipeline("dce,verify"), print_ir_after_all=True, out=out).run(parse_module(MLP))
    assert out.getvalue().count("// ----- IR after") == 2


def test_custom_pass_example_pins_a_module() -> None:
    load_plugin(ROOT / "examples" / "custom_pass.py")
    assert "pin-module" in all_passes()
    module = parse_module(MLP)
    PassManager(build_pipeline("pin-module{module=head,stage=1}")).run(module)
    assert [op.name for op in module.stages[1].ops] == ["y", "l", "o"]
    with pytest.raises(PassError, match="%dead \\(stage 0\\) would read %h from the later stage 1"):
        PassManager(build_pipeline("pin-module{module=fc1,stage=1}")).run(parse_module(MLP))


def test_entry_point_group_registers_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_passes.py").write_text(
        "from dataclasses import dataclass\n"
        "from dapple_ir.registry import Pass, register_pass\n"
        "@register_pass\n@dataclass(frozen=True)\n"
        "class Hello(Pass):\n    '''Says hello.'''\n    name = 'hello-from-entry-point'\n"
        "    def apply(self, ctx, module):\n        ctx.log('hello')\n"
    )
    dist = tmp_path / "my_passes-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-passes\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[dapple_ir.passes]\nhello = my_passes\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from dapple_ir import plugins

    monkeypatch.setitem(plugins._loaded, "builtins", False)
    assert "hello-from-entry-point" in all_passes()
    sys.modules.pop("my_passes", None)


def test_register_rejects_bad_passes() -> None:
    with pytest.raises(PassOptionError, match="kebab-case"):

        @register_pass
        @dataclass(frozen=True)
        class Bad(Pass):
            name = "Bad_Name"

    with pytest.raises(PassOptionError, match="frozen dataclass"):

        @register_pass
        class NotADataclass(Pass):
            name = "not-a-dataclass"
