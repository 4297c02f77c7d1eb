//! Chat messages to prompt text. A model's own `tokenizer.chat_template` (Jinja, as Hugging Face
//! tokenizers render it) is rendered with minijinja in a sandbox: no file or network access, a
//! fuel limit on the work a template may do, and a bound on what it may output. A model without
//! a template, or with one minijinja cannot compile, gets ChatML
//! (`<|im_start|>role\ncontent<|im_end|>\n`, then an open assistant turn), which Qwen models use
//! natively.
//!
//! Fuel bounds the work, not the depth of what a template builds: a loop that wraps a list in
//! a list a few hundred thousand times stays within it, and rendering or dropping that value
//! recurses once per level. Templates are therefore compiled and rendered on a thread of their
//! own with a stack that such a value fits in ([`RENDER_STACK`]); on a runtime thread's 2 MiB
//! it overflowed and aborted the daemon. A namespace that contains itself would recurse
//! without end on any stack; [`namespaces`] keeps templates from building one.

mod namespaces;

use minijinja::syntax::SyntaxConfig;
use minijinja::{context, Environment, Error, ErrorKind};
use spillway_proto::v1::ChatMessage;

use crate::gguf::Metadata;

use namespaces::{guard_assignments, NamespaceGuard};

/// Work a template may do per rendering (minijinja's instruction budget); real templates need
/// a few thousand for a long conversation.
const FUEL: u64 = 5_000_000;
/// Stack of the thread a template renders on: room for the deepest value [`FUEL`] lets a
/// template build (about 64 MiB in a test build). Address space only: pages are committed as
/// the recursion touches them.
const RENDER_STACK: usize = 512 << 20;
/// Longest prompt a template may render, in bytes.
const MAX_OUTPUT: usize = super::validate::MAX_PROMPT_BYTES * 2;

/// ChatML, as a template: what models without their own get.
pub const CHATML: &str = "{% for message in messages %}<|im_start|>{{ message.role }}\n\
{{ message.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n\
{% endif %}";

/// Which template a model's chats are rendered with.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatTemplate {
    /// The template as rendered: the model's, with its namespace assignments guarded.
    source: String,
    /// True when this is the model's own template, false for the ChatML fallback.
    pub from_model: bool,
    bos: String,
    eos: String,
}

impl ChatTemplate {
    /// The model's `tokenizer.chat_template` when it has one that compiles, else ChatML.
    /// `bos`/`eos` are the texts of the model's BOS and EOS tokens, which templates use.
    pub fn from_metadata(md: &Metadata, bos: &str, eos: &str) -> ChatTemplate {
        let own = md.opt_str("tokenizer.chat_template").ok().flatten();
        let fallback = || ChatTemplate {
            source: CHATML.to_string(),
            from_model: false,
            bos: bos.to_string(),
            eos: eos.to_string(),
        };
        let Some(src) = own else {
            return fallback();
        };
        let compiled = on_template_stack(|| {
            let guarded = guard_assignments(src, syntax())
                .ok_or_else(|| "the template does not lex".to_string())?;
            environment()
                .template_from_str(&guarded)
                .map_err(|e| e.to_string())?;
            Ok(guarded)
        });
        match compiled {
            Ok(source) => ChatTemplate {
                source,
                from_model: true,
                bos: bos.to_string(),
                eos: eos.to_string(),
            },
            Err(e) => {
                tracing::warn!("the model's chat template does not compile, using ChatML: {e}");
                fallback()
            }
        }
    }

    /// The ChatML fallback.
    pub fn chatml() -> ChatTemplate {
        ChatTemplate {
            source: CHATML.to_string(),
            from_model: false,
            bos: String::new(),
            eos: String::new(),
        }
    }

    /// Renders `messages` with an open assistant turn for the model to complete, on a thread
    /// with a [`RENDER_STACK`] stack.
    pub fn render(&self, messages: &[ChatMessage]) -> Result<String, String> {
        on_template_stack(|| self.render_here(messages))
    }

    fn render_here(&self, messages: &[ChatMessage]) -> Result<String, String> {
        let env = environment();
        let template = env
            .template_from_str(&self.source)
            .map_err(|e| e.to_string())?;
        let messages: Vec<_> = messages
            .iter()
            // Plain maps, which a template may store in a namespace (see `namespaces`).
            .map(|m| {
                minijinja::Value::from_pairs([
                    ("role", m.role.clone()),
                    ("content", m.content.clone()),
                ])
            })
            .collect();
        let out = template
            .render(context! {
                messages => messages,
                add_generation_prompt => true,
                bos_token => self.bos.clone(),
                eos_token => self.eos.clone(),
            })
            .map_err(|e| match e.kind() {
                ErrorKind::OutOfFuel => "the template needed too much work to render".to_string(),
                _ => e.to_string(),
            })?;
        if out.len() > MAX_OUTPUT {
            return Err(format!(
                "the template rendered {} bytes, more than the {MAX_OUTPUT} allowed",
                out.len()
            ));
        }
        Ok(out)
    }
}

/// Runs `f` (compiling or rendering a template) on a thread with a [`RENDER_STACK`] stack.
fn on_template_stack<T: Send>(f: impl FnOnce() -> Result<T, String> + Send) -> Result<T, String> {
    std::thread::scope(|scope| {
        std::thread::Builder::new()
            .name("chat-template".into())
            .stack_size(RENDER_STACK)
            .spawn_scoped(scope, f)
            .map_err(|e| format!("no thread to render the chat template on: {e}"))?
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}

/// Jinja's block trimming, as Hugging Face renders templates.
fn syntax() -> SyntaxConfig {
    SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .expect("the default delimiters are valid")
}

/// A sandboxed environment with what Hugging Face templates expect: Jinja's block trimming,
/// Python string methods, `raise_exception`; and the check of namespace assignments, with
/// state for one rendering.
fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_fuel(Some(FUEL));
    env.set_syntax(syntax());
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
        Err(Error::new(ErrorKind::InvalidOperation, msg))
    });
    let guard = NamespaceGuard::new();
    env.add_filter(namespaces::FILTER, move |v: minijinja::Value| {
        guard.lock().check(v)
    });
    env
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::Value;

    fn m(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }

    fn with_template(src: &str) -> Metadata {
        let mut md = Metadata::new();
        md.insert("tokenizer.chat_template", Value::String(src.into()))
            .unwrap();
        md
    }

    #[test]
    fn without_a_template_chats_are_chatml_with_an_open_assistant_turn() {
        let t = ChatTemplate::from_metadata(&Metadata::new(), "", "");
        assert!(!t.from_model);
        let text = t
            .render(&[m("system", "Be brief."), m("user", "Hi")])
            .unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\n"
        );
    }

    #[test]
    fn a_models_template_is_rendered_with_python_methods_and_special_tokens() {
        let src = "{{ bos_token }}{% for message in messages %}\
            {% if message.role == 'user' %}[INST] {{ message.content.strip() }} [/INST]\
            {% else %}{{ message.content }}{{ eos_token }}{% endif %}{% endfor %}";
        let t = ChatTemplate::from_metadata(&with_template(src), "<s>", "</s>");
        assert!(t.from_model);
        let text = t
            .render(&[m("user", "  Hi "), m("assistant", "Hello")])
            .unwrap();
        assert_eq!(text, "<s>[INST] Hi [/INST]Hello</s>");
    }

    #[test]
    fn raise_exception_and_runaway_templates_are_errors_not_hangs() {
        let t = ChatTemplate::from_metadata(
            &with_template("{{ raise_exception('roles must alternate') }}"),
            "",
            "",
        );
        let e = t.render(&[m("user", "x")]).unwrap_err();
        assert!(e.contains("roles must alternate"), "{e}");
        let t = ChatTemplate::from_metadata(
            &with_template(
                "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
            ),
            "",
            "",
        );
        let e = t.render(&[m("user", "x")]).unwrap_err();
        assert!(e.contains("too much work"), "{e}");
    }

    #[test]
    fn a_template_that_does_not_compile_falls_back_to_chatml() {
        let t = ChatTemplate::from_metadata(&with_template("{% for %}"), "", "");
        assert_eq!(
            t,
            ChatTemplate {
                bos: String::new(),
                eos: String::new(),
                ..ChatTemplate::chatml()
            }
        );
    }

    /// Found by fuzzing (`chat_template` in CI, a SIGSEGV): a template that nests a list in a
    /// list as deep as its fuel allows. Rendering and dropping that value recursed past a
    /// runtime thread's stack and killed the process; now it renders, or runs out of fuel, on
    /// its own thread.
    #[test]
    fn a_list_nested_as_deep_as_the_fuel_allows_is_no_crash() {
        let deep = "{% set ns = namespace(x=[]) %}{% for i in range(10000) %}\
            {% for j in range(10000) %}{% set ns.x = [ns.x] %}{% endfor %}{% endfor %}{{ ns.x }}";
        let t = ChatTemplate::from_metadata(&with_template(deep), "", "");
        assert!(t.from_model);
        // Called from a thread with a small stack, as the daemon's runtime threads are.
        let e = std::thread::Builder::new()
            .stack_size(1 << 20)
            .spawn(move || t.render(&[m("user", "x")]))
            .unwrap()
            .join()
            .unwrap()
            .unwrap_err();
        assert!(e.contains("too much work"), "{e}");
        // Shallower, it renders: 100,000 levels of brackets.
        let shallower = "{% set ns = namespace(x=[]) %}{% for i in range(100) %}\
            {% for j in range(1000) %}{% set ns.x = [ns.x] %}{% endfor %}{% endfor %}{{ ns.x }}";
        let t = ChatTemplate::from_metadata(&with_template(shallower), "", "");
        let out = t.render(&[]).unwrap();
        assert_eq!(out.len(), 2 * 100_001);
    }

    /// Found by fuzzing (`chat_template` in CI, a SIGSEGV): `{% set ns.a = ns %}` made a
    /// namespace that contains itself, and printing it recursed until the stack ran out, on
    /// any stack. Every way of storing a namespace in one is now an error.
    #[test]
    fn a_namespace_that_would_contain_itself_is_an_error_not_a_crash() {
        for src in [
            "{% set ns = namespace() %}{% set ns.a = ns %}{{ ns }}",
            "{% set ns = namespace() %}{%- set ns.a = [1, [ns]] -%}{{ ns }}",
            "{% set ns = namespace() %}{% set ns.a = {'k': ns} %}{{ ns == ns }}",
            "{% set ns = namespace() %}{% set ns.a, b = ns, 1 %}{{ ns|tojson }}",
            "{% set ns = namespace() %}{% set ns.a | default(ns, true) %}{% endset %}{{ ns }}",
            "{% set a = namespace() %}{% set b = namespace(x=a) %}{% set a.y = b %}{{ a }}",
            "{% set ns = namespace() %}{% for x in [ns] %}{% set ns.l = loop %}{% endfor %}{{ ns }}",
        ] {
            let t = ChatTemplate::from_metadata(&with_template(src), "", "");
            assert!(t.from_model, "{src}");
            let e = t.render(&[m("user", "x")]).unwrap_err();
            assert!(e.contains("a namespace attribute may hold"), "{src}: {e}");
        }
    }

    #[test]
    fn namespaces_as_real_templates_use_them_still_render() {
        // The patterns of Qwen, Mistral and DeepSeek templates: flags, indices, accumulated
        // strings and lists, a captured block.
        let src = "{% set ns = namespace(system='', last_user=-1, roles=[], seen={}) %}\
            {%- for message in messages %}\
            {%- if message.role == 'system' %}{% set ns.system = ns.system + message.content %}\
            {%- else %}{% set ns.roles = ns.roles + [message.role] %}{% endif %}\
            {%- if message.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}\
            {%- set ns.seen = {'last': message, 'count': loop.length} %}\
            {%- endfor %}\
            {%- set ns.tail | upper %}{{ ns.roles|join(',') }}{% endset %}\
            [{{ ns.system }}|{{ ns.last_user }}|{{ ns.tail }}|{{ ns.seen.last.content }}]";
        let t = ChatTemplate::from_metadata(&with_template(src), "", "");
        assert!(t.from_model);
        let text = t
            .render(&[m("system", "S"), m("user", "u"), m("assistant", "a")])
            .unwrap();
        assert_eq!(text, "[S|1|USER,ASSISTANT|a]");
    }
}
